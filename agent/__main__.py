"""``python -m agent --config JSON``: one node agent, as the local cluster starts it.

The CLI builds the :class:`agent.config.AgentConfig` and passes it as JSON; this entry point only
decodes it, sets up logging and runs the agent. Exit codes are those of docs/cli.md.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from agent.config import AgentConfig
from agent.errors import TmrunError
from agent.node import run_agent


def setup_logging(node: str, level: int = logging.INFO) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"[tmrun {node} %(asctime)s.%(msecs)03d] %(levelname)s %(message)s",
                                           datefmt="%H:%M:%S"))
    root = logging.getLogger("tmrun")
    root.handlers[:] = [handler]
    root.setLevel(level)
    root.propagate = False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m agent", description=__doc__)
    parser.add_argument("--config", required=True, help="AgentConfig as JSON")
    args = parser.parse_args(argv)
    cfg = AgentConfig.from_json(args.config)
    setup_logging(cfg.node)
    try:
        return asyncio.run(run_agent(cfg))
    except TmrunError as exc:
        print(f"tmrun {cfg.node}: error: {exc}", file=sys.stderr)
        return exc.exit_code


if __name__ == "__main__":
    sys.exit(main())
