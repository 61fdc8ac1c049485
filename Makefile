# Quick start: `make test` (set up and run the tests), `make demo` (profile the baseline workflow).
VENV ?= .venv
PY := $(VENV)/bin/python
# The Python that runs ComfyUI: its own environment (torch, torchvision, ComfyUI's requirements).
COMFY_PYTHON ?= python3
MINI := $(COMFYUI_PATH)/models/checkpoints/sdopt-mini-sd15.safetensors
# Small enough for a CPU; `make demo DEMO_SET=` runs the workflow as saved (512x512, 20 steps).
DEMO_SET ?= --set KSampler.steps=4 --set EmptyLatentImage.width=256 --set EmptyLatentImage.height=256

.PHONY: test demo clean

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	touch $@

test: $(VENV)/.installed
	$(PY) -m pytest tests

demo:
	@test -n "$(COMFYUI_PATH)" || { echo "set COMFYUI_PATH to your ComfyUI folder"; exit 2; }
	$(COMFY_PYTHON) -c "import sdopt" 2>/dev/null || $(COMFY_PYTHON) -m pip install -q -e .
	test -f $(MINI) || $(COMFY_PYTHON) -m sdopt make-model mini --out $(MINI)
	$(COMFY_PYTHON) -m sdopt run workflows/sd15_baseline.json $(DEMO_SET) --report-json out/sd15_baseline.json

clean:
	rm -rf $(VENV) out
