"""`python -m verify <command> ...`: parse, run, print, exit with the verdict's code.

Exit codes (README.md): 0 the check passed; 1 it found a fault (a wrong result, a hang, a
desync, a crashed rank); 2 the tool could not run the check or could not finish it (bad
arguments, an import error, a class that cannot be driven as the contract says, the time
ran out before a verdict); 130 interrupted (Ctrl-C; 143 for SIGTERM), with every rank ended.

Nothing here decides a verdict: commands (`commands.py`) take an options dataclass and return
a result whose `verdict` is "pass", "fault" or "timeout". Bad input is one line on stderr.
Progress goes to stderr while a command runs; stdout holds the report, or one JSON document
with `--json` (progress then stays off unless `--progress`).

Start-up imports what it shows: the table's rows name their modules as strings
(`command.py`), and only the command typed is imported (its options for its flags and
`--help`, its runner and printer to run it); `list` imports the registry and the workloads,
`--help` the table alone. `main(alone=row)` runs one row on its own: the maintainer's
scripts of `benchmarks/`, with the flags, help and exit codes of a command.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import sys
import textwrap

from verify import progress
from verify.cli.command import Command
from verify.cli.flags import add_flags, given, options_from

EXIT_PASS, EXIT_FAULT, EXIT_USAGE = 0, 1, 2
EXIT_INTERRUPTED, EXIT_TERMINATED = 130, 143


class UsageError(Exception):
    """Bad input: printed as one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, no usage dump
        # argparse puts "argument --flag: " before a message that already names the flag
        raise UsageError(re.sub(r"^argument (\S+): (?=.*\1)", "", message))


class _Help(argparse.HelpFormatter):
    """Wraps help at spaces only: a row key or a name with hyphens (`more-ranks-than-params`)
    stays whole."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)


class _Terminated(KeyboardInterrupt):
    """SIGTERM, handled as Ctrl-C is: every rank ended, one line, exit 143."""


def build_parser(
    commands: tuple[Command, ...] | None = None, flags_for: set[str] | None = None
) -> argparse.ArgumentParser:
    """`python -m verify`'s parser: a subcommand per row of `commands` (default: the table).

    `flags_for`: the commands whose flags are added (None: all). A command's flags come from
    its options dataclass, imported to read them: `parse` adds only the named command's, so
    `--help` and `list` import no checker.
    """
    from verify.cli.commands import all_commands

    parser = _Parser(
        prog="python -m verify", description="Verify data-parallel training.", formatter_class=_Help
    )
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for command in commands or all_commands():
        p = sub.add_parser(
            command.name, help=command.help, description=command.help, formatter_class=_Help
        )
        if flags_for is None or command.name in flags_for:
            _add_command_flags(p, command)
        p.set_defaults(_command=command)
    return parser


def command_parser(command: Command, prog: str) -> argparse.ArgumentParser:
    """The parser of one command run on its own, as `prog` (a script of `benchmarks/`): the
    flags, help and bad-input lines of `python -m verify <command>`."""
    parser = _Parser(prog=prog, description=command.help, formatter_class=_Help)
    _add_command_flags(parser, command)
    parser.set_defaults(_command=command)
    return parser


def _add_command_flags(p: argparse.ArgumentParser, command: Command) -> None:
    options = command.options_class()
    if options is not None:
        add_flags(p, options)
        p.add_argument("--json", action="store_true", help="print one JSON document")
        p.add_argument(
            "--progress", action="store_true",
            help="progress on stderr also under --json (on by default without it)",
        )  # fmt: skip
    if command.script:
        p.add_argument("script", nargs=argparse.REMAINDER, help="-- train.py ARGS")
    if command.positional:
        p.add_argument(command.positional, nargs="*", help="DIR_A DIR_B")


def main(argv: list[str] | None = None, *, alone: Command | None = None, prog: str = "") -> int:
    """Run `python -m verify ARGV`; with `alone`, run that one command as `prog` (the scripts of
    `benchmarks/`: `prog ARGV` takes the command's flags). Returns the exit code."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    if _main_thread():
        # At the signal itself, not when the exception reaches main(): runs in other threads
        # (the matrix's world sizes) must end their ranks now, or the executor waiting for
        # them would wait for their work to finish.
        signal.signal(signal.SIGINT, _on_signal)
        signal.signal(signal.SIGTERM, _on_signal)
    try:
        return _run(argv, alone, prog)
    except (UsageError, ValueError) as exc:  # ImplError is a ValueError
        print(f"verify: error: {_message_line(exc)}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt as exc:
        from verify.launching import interrupt

        interrupt()  # every supervised run, in every thread, ends its ranks now
        print("verify: interrupted", file=sys.stderr)
        return EXIT_TERMINATED if isinstance(exc, _Terminated) else EXIT_INTERRUPTED
    except BrokenPipeError:  # `python -m verify list | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_PASS
    finally:
        progress.disable()
        if _main_thread():
            for sig, handler in saved.items():
                signal.signal(sig, handler)


def parse(
    argv: list[str] | None, alone: Command | None = None, prog: str = ""
) -> tuple[Command, object, argparse.Namespace]:
    """The command, its options and the parsed flags; raises UsageError or ValueError (one
    line) for bad input, before anything runs. Options are None for a command without.
    `alone`: parse ARGV as the flags of that one command (`main`)."""
    argv = sys.argv[1:] if argv is None else argv
    if alone is not None:
        parser = command_parser(alone, prog or alone.name)
    else:  # only the named command's flags: its options are all that is imported
        from verify.cli.commands import MOVED

        named = next((a for a in argv if not a.startswith("-")), None)
        if named in MOVED:
            raise UsageError(
                f"{named} is not a command any more: it is a maintainer's script of the "
                f"repository, python {MOVED[named]} (same flags)"
            )
        parser = build_parser(flags_for={named} if named else set())
    args = parser.parse_args(argv)
    command: Command = args._command
    options_class = command.options_class()
    if options_class is None:
        return command, None, args
    typed = given(args) - {"command", "json", "progress", "script", command.positional}
    for a, b in command.conflicts:
        if a in typed and b in typed:
            raise UsageError(f"{_flag(command, a)} and {_flag(command, b)} cannot be used together")
    fixed = command.fixed(args) if command.fixed else {}
    if command.script:
        script = tuple(a for a in (args.script or ()) if a != "--")
        if script:
            fixed["script"] = script
        from verify.launching.launcher import is_command

        if "nproc" in typed and is_command(script):  # audit's --nproc has a default: typed?
            raise UsageError(
                f"--nproc applies to a script (--nproc N -- train.py); {script[0]} is a "
                "command, which starts its own ranks: drop --nproc"
            )
    if command.positional:
        fixed[command.positional] = tuple(getattr(args, command.positional) or ())
    return command, options_from(args, options_class, **fixed), args


def _run(argv: list[str] | None, alone: Command | None, prog: str) -> int:
    command, options, args = parse(argv, alone, prog)
    if options is None:
        print(command.printer()(None))
        return EXIT_PASS
    from verify import runs
    from verify.launching.supervisor import reset_interrupt

    reset_interrupt()
    if not args.json or args.progress:
        progress.enable(sys.stderr)
    # Nothing imported before the runner imports torch: `audit -- torchrun ...` starts the
    # launcher first (cli/head_start.py).
    result = command.runner()(options)
    progress.disable()  # a progress line on a terminal is cleared before the report
    from verify.checks.verdict import EXIT_CODES

    if int(os.environ.get("RANK", "0")) == 0:  # under torchrun, rank 0 speaks for the job
        text = command.printer()(result)
        print(json.dumps(result.to_dict(), indent=2, default=str) if args.json else text)
        folder = getattr(result, "report_dir", None) or getattr(result, "run_dir", None)
        if folder and command.report:  # the run's folder keeps what the run printed
            with contextlib.suppress(OSError):  # (a full disk: the text is printed all the same)
                with open(os.path.join(folder, f"{command.report}.txt"), "w") as f:
                    f.write(text + "\n")
        if folder and not args.json and os.path.isdir(folder):  # nothing ever cleans --out
            print(runs.disk_line(folder))
    return EXIT_CODES[result.verdict]


def _flag(command: Command, field_name: str) -> str:
    import dataclasses

    from verify.options import flag_of

    for f in dataclasses.fields(command.options_class()):
        if f.name == field_name:
            return f.metadata.get("negate") or flag_of(f)
    return "--" + field_name.replace("_", "-")


def _message_line(exc: BaseException) -> str:
    """The first line of a usage error's message, without its type (the user's words)."""
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def _on_signal(signum, frame) -> None:
    from verify.launching import interrupt

    interrupt()
    raise _Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()


def _main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()
