"""One backend's half of `miniapp bench`, in its own process.

Protocol on stdin/stdout, one line each: the worker prints `ready` once loaded; each `run`
line makes one measured run (the next prompt in turn), answered `done <decode tok/s>
<digest of the generated tokens>`; `result` prints the JSON result and exits.
A user-fixable error is printed to stderr as one line, with exit code 2.
"""

from __future__ import annotations

import argparse
import faulthandler
import hashlib
import json
import sys
from pathlib import Path

from miniapp.engine.api import WINDOW_POLICY, MiniappError
from miniapp.engine.evaluation.benchmark import BenchSession

from .worker_process import EXIT_USAGE


def main() -> int:
    # A native crash leaves the stack of every thread on stderr (the parent reports it in
    # one line and keeps this for debugging).
    faulthandler.enable()
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", required=True)
    parser.add_argument("--model", required=True, type=Path)
    parser.add_argument(
        "--prompts", required=True, type=Path, help="JSON list of prompts (token id lists)"
    )
    parser.add_argument("--tokens", required=True, type=int)
    parser.add_argument("--ctx", required=True, type=int)
    parser.add_argument("--threads", type=int)
    parser.add_argument("--sinks", type=int)
    parser.add_argument("--window", type=int)
    parser.add_argument("--kv-policy", default=WINDOW_POLICY)
    parser.add_argument("--spec", default="off")
    parser.add_argument("--stop-at-end-of-turn", action="store_true")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--kv-type", help="the KV cache type (default: the backend's own)")
    args = parser.parse_args()
    prompts = json.loads(args.prompts.read_text())
    try:
        session = BenchSession(
            args.backend,
            args.model,
            prompts,
            args.tokens,
            args.threads,
            args.ctx,
            sinks=args.sinks,
            window=args.window,
            kv_policy=args.kv_policy,
            spec=args.spec,
            stop_at_end_of_turn=args.stop_at_end_of_turn,
            device=args.device,
            kv=args.kv_type,
        )
    except MiniappError as exc:
        print(exc, file=sys.stderr)
        return EXIT_USAGE
    _reply("ready")
    for line in sys.stdin:
        command = line.strip()
        if command == "run":
            stats = session.run_once()
            digest = hashlib.sha256(json.dumps(stats.tokens).encode()).hexdigest()[:16]
            _reply(f"done {stats.decode_tok_s} {digest}")
        elif command == "result":
            _reply(json.dumps(session.result().to_dict()))
            return 0
    return 1  # stdin closed without asking for the result


def _reply(text: str) -> None:
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    sys.exit(main())
