#!/usr/bin/env bash
# check_plain_install.sh as most users run it: from inside a virtual environment that holds torch
# itself, made from a base interpreter without torch (Debian's python3 here; the suite's python3
# where there is none), so only the active venv's packages can satisfy the plain install's imports.
set -euo pipefail
cd "$(dirname "$0")/.."
base=python3
if [ -x /usr/bin/python3 ] && ! /usr/bin/python3 -c 'import torch' 2> /dev/null \
   && /usr/bin/python3 -c 'import ensurepip, venv' 2> /dev/null; then
  base=/usr/bin/python3
fi
outer="$(mktemp -d)/user-venv"
trap 'rm -rf "$(dirname "$outer")"' EXIT
"$base" -m venv "$outer"
torch_version="$(python3 -c 'import torch; print(torch.__version__.split("+")[0])')"  # the suite's
"$outer/bin/python" -m pip install -q --disable-pip-version-check "torch==$torch_version" numpy
# shellcheck disable=SC1091
. "$outer/bin/activate"
echo "check_plain_install_in_venv: inside $VIRTUAL_ENV (base $base)"
bash scripts/check_plain_install.sh
