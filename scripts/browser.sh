#!/usr/bin/env bash
# Debian's chromium and chromium-driver for the real-browser test (tests/test_browser.py: JupyterLab driven by
# selenium). Installed with apt where this runs as root on Debian / Ubuntu; elsewhere it says how, and the test
# is skipped with that reason while the rest of the suite runs.
set -euo pipefail
if command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; then
  exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
  echo "no browser for the real-browser test: install Debian's chromium and chromium-driver (apt-get install chromium chromium-driver, as root)" >&2
  exit 0
fi
echo "installing Debian's chromium and chromium-driver for the real-browser test ..." >&2
export DEBIAN_FRONTEND=noninteractive
if ! { apt-get update -qq && apt-get install -y -qq chromium chromium-driver; } >/tmp/gradkit-browser-apt.log 2>&1; then
  echo "could not install chromium (see /tmp/gradkit-browser-apt.log): the real-browser test will be skipped" >&2
fi
