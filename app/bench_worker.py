"""One backend's half of `miniapp bench`, run in its own process; prints one JSON line."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from miniapp.engine.benchmark import measure
from miniapp.engine.errors import MiniappError

EXIT_USAGE = 2


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", required=True)
    parser.add_argument("--model", required=True, type=Path)
    parser.add_argument("--prompt", required=True, type=Path, help="JSON list of token ids")
    parser.add_argument("--tokens", required=True, type=int)
    parser.add_argument("--ctx", required=True, type=int)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--threads", type=int)
    args = parser.parse_args()
    prompt = json.loads(args.prompt.read_text())
    try:
        result = measure(
            args.backend, args.model, prompt, args.tokens, args.threads, args.ctx, args.runs
        )
    except MiniappError as exc:
        print(exc, file=sys.stderr)
        return EXIT_USAGE
    print(json.dumps(result.to_dict()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
