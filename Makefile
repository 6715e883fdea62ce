# The two set-up commands of the README. Each installs what it needs first.
.PHONY: setup run test bench-io

setup:
	./scripts/setup.sh

run: setup
	.venv/bin/flashmoe run

# The suite, its skips with their reasons (-ra) and the 20 slowest tests.
test: setup
	.venv/bin/python -m pytest --durations=20
