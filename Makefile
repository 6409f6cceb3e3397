# Two commands on a fresh machine:  make demo  and  make test.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
# CPU-only machines get torch's CPU build first, so pip never pulls CUDA wheels.
TORCH  ?= torch==2.13.0
WORLD  ?= 3

.PHONY: demo test test-deep lint install lessons bench soak clean

# pip byte-compiles what it installs on one core; compileall does the same on every core (-j 0), once at the end:
# 7 s of a fresh install's 42 on two cores.  Like pip, it goes on past a file this Python cannot compile (torch
# ships one in 3.12 syntax for its own tests), so its status is not the install's.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	@if $(PY) -c "import torch" 2>/dev/null; then echo "torch already installed"; \
	elif command -v nvidia-smi >/dev/null 2>&1; then $(PY) -m pip install --quiet --no-compile torch; \
	else $(PY) -m pip install --quiet --no-compile $(TORCH); fi
	$(PY) -m pip install --quiet --no-compile -e '.[dev]'
	$(PY) -m compileall -q -j 0 "$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" >/dev/null || true
	$(PY) -m ipykernel install --sys-prefix --name python3 >/dev/null
	touch $@

install: $(VENV)/.installed

# The lesson notebooks in JupyterLab (not needed by `make test`, which executes them without it).
lessons: install
	$(PY) -m pip install --quiet -e '.[dev,lab]'
	$(PY) -m jupyter lab lessons/

STAGES ?= ddp,ddp-bucketed,zero1,zero2,zero3

demo: install
	$(PY) -m minizero compare --world-size $(WORLD) --stages $(STAGES) --accum 2
	$(PY) -m minizero compare --world-size $(WORLD) --stages $(STAGES) --accum 2 --compress fp16
	$(PY) -m minizero compare --world-size $(WORLD) --stages $(STAGES) --accum 2 --precision bf16
	$(PY) -m minizero memory --params 7.5e9 --world-size 64
	$(PY) -m minizero compare --world-size $(WORLD) --stages $(STAGES) --dtype float64 --backend native
	$(PY) -m minizero train --stage zero3 --world-size 2 --steps 20 --save .demo-run --save-every 10
	$(PY) -m minizero train --stage ddp --world-size 3 --steps 20 --resume .demo-run/step-00000010

# Lint first (a second), then the suite and every lesson notebook.
lint: install
	$(PY) -m ruff check minizero tests

# First, alone, the tests that compare durations (tests/conftest.py marks them `alone`: the dialled network,
# overlap, the cost model, the mutants) and those that sample malloc (lesson 18, the predicted peak).  Then everything else with the lessons, two at a time on two cores
# (pytest-xdist): nothing there is asserted on timing but the bounded waits -- stall timeouts, deadlines, launches
# that end -- which hold seconds of margin.  Two workers, not three: the suite is CPU-bound (user + sys = 1.95 cores
# with three), and a third worker's ranks only add context switches -- gloo's every message wakes its loop thread
# and then the waiting one, about 0.4 ms of CPU a round trip on these machines.  Measured back to back on one
# 2-core machine: three workers 1383 s wall, 2702 s CPU; two 1244 s, 2339 s.
# One intra-op thread per process there (OMP_NUM_THREADS=1; the pools' ranks set their own): two workers, their
# ranks and the lessons' kernels on two cores are oversubscribed already, and torch's threads would contend
# (measured: lessons 8, 9 and 18 together 41 s against 49 s).  Each phase prints its slowest tests: where the
# minutes go (the suite is over its 12-minute budget on two cores).  A lesson's cell may take 900 s there -- a guard
# against a hang, not a measure of speed: lessons once ran 10-20 times slower there than alone (lesson 10: 21 s alone,
# 456 s beside two workers), mostly because idle process groups leaked into the pools -- 736 gloo loop threads, each
# waking every 10 ms (minizero.comm.native.subgroup now makes each group once); now about 2-4 times.
# Lessons are named before tests: xdist hands out the xdist_group bundles first, then single tests in the order
# named, so the lessons (up to 140 s each there) start early and no long one starts last, alone, at the end.
test: install lint
	$(PY) -m pytest -q tests lessons --nbmake --nbmake-timeout=300 -m alone --durations=15
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n 2 --dist loadgroup -m "not alone" lessons tests --nbmake --nbmake-timeout=900 \
	  --durations=40

# Hunting: many more random examples, fresh seeds each run.
test-deep: install
	MINIZERO_DEEP=1 $(PY) -m pytest -q tests -x

bench: install
	$(PY) -m minizero bench collectives --world-size 2
	$(PY) -m minizero bench ddp --world-size 2
	$(PY) -m minizero bench zero --world-size 2
	$(PY) -m minizero bench zero3 --world-size 2
	$(PY) -m minizero bench overlap --world-size 2
	$(PY) -m minizero bench check --world-size 2
	$(PY) -m minizero bench precision --world-size 2
	$(PY) -m minizero bench all --world-size 2 --plot bench_all.png
	$(PY) -m minizero bench overlap --world-size 2 --network lesson
	$(PY) -m minizero bench buckets --world-size 2 --network lesson
	$(PY) -m minizero bench prefetch --world-size 2 --network lesson
	$(PY) -m minizero bench compress --world-size 2 --network lesson
	$(PY) -m minizero bench efficiency --world-size 2 --network lesson
	$(PY) -m minizero scale --params 1.5e9 --world-size 1..1024 --network ethernet-100g --compute-ms 300

# Every stage beside the reference for 500 steps: the largest deviation over the run (minutes, not CI).
soak: install
	$(PY) -m minizero soak --world-size 4 --steps 500

clean:
	rm -rf $(VENV) *.egg-info .demo-run
