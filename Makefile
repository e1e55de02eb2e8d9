# k3rl: every target bootstraps what it needs (idempotent, cached; see scripts/bootstrap.sh).
VENV   ?= .venv
PY     := $(VENV)/bin/python
ARGS   ?=

.PHONY: bootstrap lock test test-fast train bench bench-cli bench-sandbox bench-server-load bench-restore-paths bench-move bench-state-move-cpu bench-model bench-kernels bench-train bench-learning bench-teacher bench-engines bench-microvm bench-tree bench-agent-learning bench-agent-episode-cpu image lint

bootstrap:
	@bash scripts/bootstrap.sh

## Re-resolve requirements.lock (the exact versions the bootstrap installs) after changing dependencies
## in pyproject.toml; commit the result. The next `make` target re-syncs .venv with it.
lock:
	@python3 scripts/lock.py

## The whole test suite (real dockerd, CRIU, Ray; Triton interpreter on CPU): the lanes side by side,
## then the `serial` tests alone (tests/conftest.py says why).
test: bootstrap
	$(VENV)/bin/pytest tests -n 2 -m "not serial" --durations=30
	$(VENV)/bin/pytest tests -m serial --durations=10

## The main job: the tiny K3 policy learns the default task (override with ARGS="key=value ...").
train: bootstrap
	$(PY) -m rl.train $(ARGS)

image: bootstrap
	$(VENV)/bin/agentenv images build

bench: bench-cli bench-model bench-kernels bench-sandbox bench-server-load bench-restore-paths bench-microvm bench-move bench-state-move-cpu bench-train bench-learning bench-teacher bench-engines bench-tree bench-agent-learning bench-agent-episode-cpu

bench-cli: bootstrap
	$(PY) bench/cli_startup.py $(ARGS)

bench-model: bootstrap
	$(PY) bench/model.py $(ARGS)

bench-kernels: bootstrap
	$(PY) bench/kernels.py $(ARGS)

bench-sandbox: bootstrap
	$(PY) bench/sandbox.py $(ARGS)

bench-server-load: bootstrap
	$(PY) bench/sandbox_server_load.py $(ARGS)

bench-restore-paths: bootstrap
	$(PY) bench/restore_paths.py $(ARGS)

## The microvm backend beside the container backend (resume, pause, fork, forks' memory) -> docs/benchmarks.md
bench-microvm: bootstrap
	$(PY) bench/microvm.py $(ARGS)

bench-move: bootstrap
	$(PY) bench/move.py $(ARGS)

## Needs perf (Debian's linux-perf, installed here when missing; the tests do not need it).
bench-state-move-cpu: bootstrap
	@bash scripts/ensure_perf.sh
	$(PY) bench/state_move_cpu.py $(ARGS)

bench-train: bootstrap
	$(PY) bench/train.py $(ARGS)

bench-learning: bootstrap
	$(PY) bench/learning.py --seeds 5 $(ARGS)

bench-teacher: bootstrap
	$(PY) bench/teacher.py $(ARGS)

bench-engines: bootstrap
	$(PY) bench/engines.py $(ARGS)

## Chain vs tree GRPO on two tasks, 3 seeds each, from a cold start per task (about 4.5 hours) -> docs/benchmarks.md
bench-tree: bootstrap
	$(PY) bench/tree.py $(ARGS)

## The shipped agent program's time to make train's target, against make train's (2 seeds, ~30 min; --seeds 3 ~40 min) -> docs/benchmarks.md
bench-agent-learning: bootstrap
	$(PY) bench/agent_learning.py $(ARGS)

## Where an agent program's episode spends its sandbox's CPU (~1 min) -> docs/benchmarks.md
bench-agent-episode-cpu: bootstrap
	$(PY) bench/agent_episode_cpu.py $(ARGS)

lint: bootstrap
	$(VENV)/bin/ruff check .
