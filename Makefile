# Two entry points for a fresh machine: `make demo` (the whole pipeline on the shipped tiny-multi backbone)
# and `make test` (the suite). Both create .venv on first use.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# e.g. https://download.pytorch.org/whl/cu128 for CUDA wheels on aarch64 (GH200) nodes (see README)
TORCH_INDEX_URL ?=

.PHONY: test demo lint venv bubblewrap multinode-tools clean bench

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# Without CUDA, torch must come from the pinned CPU wheel *before* anything depends on it;
	# an unpinned resolve would pull a multi-GB CUDA build.
	if [ -n "$(TORCH_INDEX_URL)" ]; then \
	    $(BIN)/python -m pip install -q torch --index-url $(TORCH_INDEX_URL); \
	elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then \
	    $(BIN)/python -m pip install -q torch; \
	else \
	    $(BIN)/python -m pip install -q torch==2.13.0; \
	fi
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

test: $(STAMP) bubblewrap multinode-tools
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(BIN)/python -m pytest -q -rfEs tests

demo: $(STAMP)
	$(BIN)/python -m tdlm.demo

lint: $(STAMP)
	$(BIN)/ruff check .

bench: $(STAMP)
	$(BIN)/python bench/temporal_overhead.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
