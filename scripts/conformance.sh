#!/usr/bin/env bash
# The conformance suite (tests/conformance/): transformers' own common model tests (ModelTesterMixin, ConfigTester)
# from the installed transformers version's sdist, one tester per family plus transformers' Llama as the control,
# and our generation checks. The sdist is downloaded with pip on first use into .cache/transformers-tests/<version>/
# (git-ignored, reused afterwards). Run after `pip install -e ".[test]"` (scripts/test.sh); arguments go to pytest
# (e.g. -x, -k fox). .ci/run runs it at the newest and at the lowest supported transformers.
set -euo pipefail
cd "$(dirname "$0")/.."
SELECTIVE_ROPE_CONFORMANCE=1 python -m pytest tests/conformance "$@"
