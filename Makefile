# The two set-up commands of the README. Each installs what it needs first.
.PHONY: setup run test test-docker bench-io

setup:
	./scripts/setup.sh

run: setup
	.venv/bin/flashmoe run

# The suite, its skips with their reasons (-ra) and the 20 slowest tests.
test: setup
	.venv/bin/python -m pytest --durations=20

# The image and the compose stack on a real Docker engine (root: installs docker.io and
# debootstrap, starts an engine when none answers); its last line is one JSON summary.
test-docker: setup
	.venv/bin/python scripts/docker-test.py
