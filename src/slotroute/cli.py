"""``slotroute`` command line: ``bench`` (store / wire benchmarks) and ``demo`` (vLLM end to end)."""

from __future__ import annotations

import argparse
import importlib
import sys

# Each subcommand lives in its own module exposing ``add_arguments(parser)`` and
# ``run(args) -> int``; it is imported only when chosen, so ``slotroute bench`` never
# imports torch or vLLM.
SUBCOMMANDS = {
    "bench": ("slotroute.tools.bench", "benchmark store_batch, get and the wire format on model presets"),
    "demo": ("slotroute.tools.demo", "serve a tiny MoE with vLLM and check every request's routing"),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="slotroute", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module, help_text) in SUBCOMMANDS.items():
        # A placeholder: the chosen module registers the real arguments (and --help) below.
        sub.add_parser(name, help=help_text, add_help=False).set_defaults(_module=module)
    args, _ = parser.parse_known_args(argv)
    module = importlib.import_module(args._module)
    full = argparse.ArgumentParser(prog=f"slotroute {args.command}", description=SUBCOMMANDS[args.command][1])
    module.add_arguments(full)
    argv = sys.argv[1:] if argv is None else argv
    return int(module.run(full.parse_args(argv[1:])) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
