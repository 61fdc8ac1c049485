# Quick start on a fresh machine: `make test` (set up everything, run every tier that can run here),
# `make demo` (the baseline workflow headless on the reference model: the picture asked for, profiled), `make serve` (ComfyUI with sdopt on localhost).
# ComfyUI comes from COMFYUI_PATH (used as it is), COMFYUI_SRC (copied) or the registry (0.3.75);
# see tools/setup-comfyui.sh. Everything it installs lives in the ignored $(SDOPT_HOME).
SDOPT_HOME ?= .comfyui
export SDOPT_HOME
PY := $(SDOPT_HOME)/venv/bin/python
COMFY = $(shell cat $(SDOPT_HOME)/comfyui-path)
MODELS := $(abspath $(SDOPT_HOME)/models)
MINI := $(MODELS)/checkpoints/sdopt-mini-sd15.safetensors
# The sdxl workflows and the SDXL host tests load this one (2 GB, about a minute to write).
MINI_SDXL := $(MODELS)/checkpoints/sdopt-mini-sdxl.safetensors
# sd35_fast and flux_lowvram load these (the host tests generate their own on first use); Flux's text
# encoder goes to $(MODELS)/text_encoders.
MINI_SD35 := $(MODELS)/checkpoints/sdopt-mini-sd35.safetensors
MINI_FLUX := $(MODELS)/checkpoints/sdopt-mini-flux.safetensors
# The reference SD1.5 model trained here: it draws its caption (a shape, its colour, the background, the quadrant, the size).
REF_SD15 := $(MODELS)/checkpoints/sdopt-ref-sd15.safetensors
PORT ?= 8188
# The demo asks the reference model for this caption at its default settings (64x64, 20 euler steps, CFG 5);
# `make demo DEMO_PROMPT="a small white circle on a black background, bottom right"` asks for another.
DEMO_PROMPT ?= a large red triangle on a blue background, top left
DEMO_SET ?= --set CheckpointLoaderSimple.ckpt_name=sdopt-ref-sd15.safetensors --set EmptyLatentImage.width=64 \
	--set EmptyLatentImage.height=64 --set KSampler.cfg=5 --set "Positive prompt.text=$(DEMO_PROMPT)" --set "Negative prompt.text="

# `make soak SOAK_ARGS="--prompts 20 --seed 3"`: fewer prompts, another draw.
SOAK_ARGS ?=

.PHONY: test demo serve soak comfyui clean FORCE

# Re-checked on every call: the script only installs what changed (ComfyUI, torch pins, pyproject).
$(SDOPT_HOME)/comfyui-path: FORCE
	@mkdir -p $(SDOPT_HOME)
	@tools/setup-comfyui.sh > $@.tmp && tail -n 1 $@.tmp > $@ && rm $@.tmp

comfyui: $(SDOPT_HOME)/comfyui-path

$(MINI): | comfyui
	$(PY) -m sdopt make-model mini --out $@

$(MINI_SDXL): | comfyui
	$(PY) -m sdopt make-model sdxl-mini --out $@

$(MINI_SD35): | comfyui
	$(PY) -m sdopt make-model sd35-mini --out $@

$(MINI_FLUX): | comfyui
	$(PY) -m sdopt make-model flux-mini --out $@

$(REF_SD15): | comfyui
	$(PY) -m sdopt make-model ref-sd15 --out $@

# The unit tier on two workers, each taking whole files (a file's tests keep their order): its cold
# compiles and fresh-process measurements then share both cores. Then the host tier in one process (it
# loads every family's mini and reaches 13 GB of RSS), beside, in a second process of one torch thread,
# the files whose work runs in servers and bench children of their own (the bench suite's dry run, the
# chaos soak, the browser and GPU tiers): one host process keeps only 1.3 of the 2 cores busy. Their log
# prints when both end. See docs/design.md ("What CI's time goes to").
TEST_ENV = COMFYUI_PATH=$(COMFY) SDOPT_TEST_MODELS=$(MODELS)/checkpoints
HOST_APART = tests/host/tools/test_bench_suite.py tests/host/tools/test_soak.py
HOST_APART_LOG = out/test-host-apart.log
test: comfyui $(MINI) $(MINI_SDXL) $(MINI_SD35) $(MINI_FLUX)
	$(TEST_ENV) $(PY) -m pytest -n 2 --dist loadfile tests/unit
	mkdir -p out
	$(TEST_ENV) OMP_NUM_THREADS=1 $(PY) -m pytest $(HOST_APART) tests/browser tests/gpu > $(HOST_APART_LOG) 2>&1 & apart=$$!; \
	$(TEST_ENV) $(PY) -m pytest tests/host $(HOST_APART:%=--ignore=%); host=$$?; \
	wait $$apart; other=$$?; echo "== $(HOST_APART) tests/browser tests/gpu (run beside the above)"; cat $(HOST_APART_LOG); \
	exit $$(( host || other ))

demo: comfyui $(REF_SD15) $(MINI)
	$(PY) -m sdopt run workflows/sd15_baseline.json --comfyui $(COMFY) --models $(MODELS) $(DEMO_SET) --report-json out/sd15_baseline.json

serve: comfyui $(MINI) $(MINI_SDXL) $(MINI_SD35) $(MINI_FLUX)
	$(PY) -m sdopt serve --comfyui $(COMFY) --models $(MODELS) --port $(PORT)

# Not part of `make test` or CI: 100 random prompts on a live server, under 30 min on 2 CPU cores.
soak: comfyui $(MINI) $(MINI_SDXL) $(MINI_SD35) $(MINI_FLUX)
	$(PY) -m sdopt soak --comfyui $(COMFY) --models $(MODELS) $(SOAK_ARGS)

clean:
	rm -rf $(SDOPT_HOME) out
