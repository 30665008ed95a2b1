#!/usr/bin/env bash
# guidellm (the vLLM ecosystem's load generator, from PyPI) in a virtual environment of its own under
# ~/.cache/kaon, so its dependencies never touch the project's; bench/overload.py --guidellm uses it.
set -euo pipefail
venv="${KAON_CACHE:-$HOME/.cache/kaon}/guidellm-venv"
[ -x "$venv/bin/guidellm" ] && { echo "$venv/bin/guidellm"; exit 0; }
python3 -m venv "$venv"
"$venv/bin/pip" install -q "guidellm==0.8.1"
echo "$venv/bin/guidellm"
