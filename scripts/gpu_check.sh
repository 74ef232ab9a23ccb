#!/usr/bin/env bash
# The torch engine's GPU paths against its CPU path, with a table at the end (< 5 minutes).
#
#   scripts/gpu_check.sh [--model PATH] [--tokens N] [--runs N] [--path NAME]... [--json FILE]
#
# Where miniapp is not installed (a lent GPU machine has torch and numpy but not our other
# dependencies), first run `scripts/gpu_check.sh --bundle` on a machine where `make setup`
# has run: it copies gguf, platformdirs, PyYAML, diskcache and llama-cpp-python (a ctypes
# binding, so its libraries work under any Python 3) into .gpu_site/, which this script then uses.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
site="$repo/.gpu_site"

if [ "${1:-}" = "--bundle" ]; then
    packages=$("$repo/.venv/bin/python" -c 'import site; print(site.getsitepackages()[0])')
    rm -rf "$site" && mkdir -p "$site"
    for name in gguf platformdirs yaml llama_cpp diskcache; do
        cp -a "$packages/$name" "$site/"
    done
    find "$site" -name __pycache__ -prune -exec rm -rf {} +
    du -sh "$site"
    exit 0
fi

python=${PYTHON:-}
if [ -z "$python" ]; then
    if [ -x "$repo/.venv/bin/python" ]; then python="$repo/.venv/bin/python"; else python=python3; fi
fi
if ! "$python" -c "import miniapp.engine" 2>/dev/null; then
    # Not installed: expose the checkout under the `miniapp` namespace, as the package does.
    namespace=$(mktemp -d)
    mkdir "$namespace/miniapp"
    for part in app engine native assets; do ln -s "$repo/$part" "$namespace/miniapp/$part"; done
    export PYTHONPATH="$namespace:$site${PYTHONPATH:+:$PYTHONPATH}"
fi
exec "$python" "$repo/scripts/gpu_check.py" "$@"
