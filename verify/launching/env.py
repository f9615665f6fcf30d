"""The environment variables the tool sets and reads, and the default stall timeout: one leaf
module, imported by every part of the launcher that needs them (and by nothing it imports).

impls/faulty/hang_scenarios.py spells `STALL_ENV` out again: `impls` imports nothing of
`verify`.
"""

SPAWNED_ENV = "DDP_VERIFY_SPAWNED"  # marks our ranks: they must not mistake us for torchrun
STALL_ENV = "DDP_VERIFY_STALL_TIMEOUT"  # ranks can read their stall timeout (scenarios do)
HANG_DIR_ENV = "DDP_VERIFY_HANG_DIR"  # under torchrun: this node's report folder
NO_ZYGOTE_ENV = "DDP_VERIFY_NO_ZYGOTE"  # "1": always start fresh interpreters
JOBS_ENV = "DDP_VERIFY_JOBS"  # test runs or tools sharing the machine (the thread budget)
# A launcher command's processes (`command.py`): the run's report folder (bootstrap/ spells it
# out again: it imports nothing), the audit's period ("" for none), "1" for --sanitize, and
# under --on-cpu the GPUs the rehearsed node has (--nproc; "" when off: bootstrap/ spells it
# out again too).
LAUNCHED_ENV = "DDP_VERIFY_LAUNCHED"
LAUNCHED_AUDIT_ENV = "DDP_VERIFY_LAUNCHED_AUDIT"
LAUNCHED_SANITIZE_ENV = "DDP_VERIFY_LAUNCHED_SANITIZE"
LAUNCHED_ON_CPU_ENV = "DDP_VERIFY_LAUNCHED_ON_CPU"
# No collective issued or completed by any rank for this long while one waits and none works
# (see the watchdog): a hang. The one default of every command and helper.
DEFAULT_STALL_TIMEOUT_S = 10.0
