#!/usr/bin/env bash
# Installs everything the tests and the demo need on a fresh machine (idempotent):
# GoogleTest, torch 2.13.0 (CPU), and this package with its test extras.
set -euo pipefail
cd "$(dirname "$0")/.."
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
if [ ! -f /usr/include/gtest/gtest.h ]; then
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq libgtest-dev
fi
python3 -m pip install -q --disable-pip-version-check torch==2.13.0
python3 -m pip install -q --disable-pip-version-check ".[test]"
