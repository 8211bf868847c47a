# Targets named by the README. Each one runs the (idempotent) setup first.
.PHONY: setup test serve

setup:
	launcher/setup

# the suite over the machine's cores (at most 4 workers): on a fresh 2-core machine, whose Mesa shader
# cache is empty, 27 min against 43 in one process (lavapipe's pipeline compiles dominate)
test: setup
	.venv/bin/python -m pytest -q -n auto --maxprocesses 4

serve: setup
	.venv/bin/vkflash serve
