# Two entry points for a fresh machine: `make demo` (the whole pipeline on the shipped tiny-multi backbone)
# and `make test` (the suite). Both create .venv on first use.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# Where torch comes from; empty: scripts/torch_install.sh chooses (the CPU wheel without a working nvidia-smi, else
# https://download.pytorch.org/whl/cuXYZ by driver). Set it to choose yourself, e.g. .../whl/cu126 or .../whl/cpu.
TORCH_INDEX_URL ?=

.PHONY: test demo lint venv bubblewrap multinode-tools clean bench

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch==2.13.0 (the release the suite runs) *before* anything depends on it: without a working nvidia-smi the
	# CPU wheel as configured; with one, the CUDA build the driver can run, then a check that CUDA works.
	# The script prints what it chose and why (TORCH_INDEX_URL overrides the index).
	TORCH_INDEX_URL='$(TORCH_INDEX_URL)' bash scripts/torch_install.sh $(BIN)/python
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $(STAMP)

# The MBPP sandbox prefers bubblewrap (tdlm.evaluation.sandbox); install Debian's package when we may (root +
# apt-get), so the backend users get on Debian is the one the suite tests. Never fails: without it the sandbox uses
# its in-house namespaces and the suite skips the bubblewrap tests with the reason. BWRAP=skip leaves it alone.
BWRAP ?= install
venv: $(STAMP) bubblewrap

bubblewrap:
	@if [ "$(BWRAP)" = skip ]; then echo "bubblewrap: left as it is (BWRAP=skip)"; \
	elif command -v bwrap >/dev/null 2>&1; then echo "bubblewrap: $$(command -v bwrap)"; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    (apt-get install -y -qq bubblewrap >/dev/null 2>&1 || (apt-get update -qq >/dev/null 2>&1 && \
	     apt-get install -y -qq bubblewrap >/dev/null 2>&1)) && echo "bubblewrap: installed with apt-get" || \
	    echo "bubblewrap: apt-get install failed; the sandbox uses its in-house namespaces"; \
	else echo "bubblewrap: not installed (needs root + apt-get); the sandbox uses its in-house namespaces"; fi

# The `deepspeed --hostfile` test (tests/test_multinode_training.py) needs pdsh and an sshd binary (it runs its own
# sshd on a free loopback port and stops it). Opt-in, since openssh-server is a server a user may not want installed:
# `make test MULTINODE_TOOLS=install` (CI does); without them that one test is skipped with the reason.
MULTINODE_TOOLS ?= skip
multinode-tools:
	@if [ "$(MULTINODE_TOOLS)" != install ]; then :; \
	elif command -v pdsh >/dev/null 2>&1 && [ -x /usr/sbin/sshd ]; then echo "multinode tools: pdsh and sshd present"; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    (apt-get install -y -qq pdsh openssh-server >/dev/null 2>&1 || (apt-get update -qq >/dev/null 2>&1 && \
	     apt-get install -y -qq pdsh openssh-server >/dev/null 2>&1)) && echo "multinode tools: installed with apt-get" || \
	    echo "multinode tools: apt-get install failed; the hostfile test is skipped"; \
	else echo "multinode tools: need root + apt-get; the hostfile test is skipped"; fi

# Two passes over one suite: the single-process tests in TEST_WORKERS pytest-xdist workers (a test file stays on one
# worker, so module fixtures are built once), then the tests marked slow (DeepSpeed launches, Ray clusters, deadline
# checks) in SLOW_WORKERS workers, the same way. Three slow files at a time on this 2-core machine: much of a slow
# test is process start-up, rendezvous, polling and waiting on a deadline, and every one of them passed several at a
# time at a load of 8-12 (their time limits are generous); tests/conftest.py hands the longest files out first.
# SLOW_WORKERS=0 runs them one at a time in one process. Both passes always run; `make test` fails if either does.
# TEST_ARGS reaches both (e.g. TEST_ARGS='-k sandbox').
# DeepSpeed's CPU ops build into TORCH_EXTENSIONS_DIR behind a lock file; one per venv keeps a second checkout's
# build (other include paths) from rebuilding, or waiting on a killed build's lock, in this one's.
TEST_WORKERS ?= 2
SLOW_WORKERS ?= 3
TEST_ARGS ?=
test: $(STAMP) bubblewrap multinode-tools
	@export OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1}; \
	export TORCH_EXTENSIONS_DIR=$${TORCH_EXTENSIONS_DIR:-$(abspath $(VENV))/torch_extensions}; \
	$(BIN)/python -m pytest -q -rfEs -n $(TEST_WORKERS) --dist loadfile -m 'not slow' $(TEST_ARGS) tests; fast=$$?; \
	$(BIN)/python -m pytest -q -rfEs --durations=12 -n $(SLOW_WORKERS) --dist loadfile -m slow $(TEST_ARGS) tests; \
	slow=$$?; \
	echo "make test: single-process pass exit $$fast, slow pass exit $$slow"; \
	for rc in $$fast $$slow; do [ $$rc -eq 0 ] || [ $$rc -eq 5 ] || exit 1; done

demo: $(STAMP)
	$(BIN)/python -m tdlm.demo

lint: $(STAMP)
	$(BIN)/ruff check .

bench: $(STAMP)
	$(BIN)/python bench/temporal_overhead.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
