# Targets named by the README. Each one runs the (idempotent) setup first.
.PHONY: setup test serve

setup:
	launcher/setup

test: setup
	.venv/bin/python -m pytest -q

serve: setup
	.venv/bin/vkflash serve
