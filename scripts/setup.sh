#!/usr/bin/env bash
# One-time machine and project set-up: Debian -dev packages, the project virtualenv with the
# torch==2.13.0 CPU wheel (its include/ and CMake config are our C++ SDK) and the Python packages
# used by reference tests and benchmarks. Idempotent: a stamp file skips work already done.
set -euo pipefail
cd "$(dirname "$0")/.."

# chromium: only the test that renders `loom plot`'s SVG in a real browser (tests/ux) uses it.
APT_PACKAGES=(cmake ninja-build g++ ccache libtomlplusplus-dev nlohmann-json3-dev libcli11-dev
  libgtest-dev libgmock-dev libbenchmark-dev libgloo-dev clang-14 fortunes chromium)
missing=()
for p in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "setup: installing Debian packages: ${missing[*]}"
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi

# The stamp is a copy of the requirements last installed: a venv made before a package was added
# (tensorboard, for issue 14's test) gets it on the next set-up, not only a fresh one.
PY_STAMP=.venv/.loom-setup-requirements
if ! cmp -s requirements.txt "$PY_STAMP"; then
  echo "setup: installing requirements.txt into .venv (torch==2.13.0 CPU and reference packages)"
  [ -x .venv/bin/python ] || python3 -m venv .venv
  .venv/bin/pip install -q --disable-pip-version-check -r requirements.txt
  cp requirements.txt "$PY_STAMP"
fi

# The default corpus: English text from Debian's `fortunes` package (BSD licence, see README).
# Remade when scripts/default_data.version changes, so an old checkout's data follows the recipe.
if [ ! -f data/default/corpus.txt ] || ! cmp -s data/default/VERSION scripts/default_data.version; then
  scripts/make_default_data.sh
fi
