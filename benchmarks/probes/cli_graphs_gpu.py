"""`kvbits generate` on a GPU machine without network: the CUDA-graph default (GreedyDecoder)
against `--no-graphs` (transformers' generate), same tokens expected.

    python3 benchmarks/probes/cli_graphs_gpu.py CONFIG_DIR

CONFIG_DIR holds SmolLM2's config and tokenizer files (no weights: the hub and PyPI are out of
reach there), and its sibling `texts/` kvbits' cached texts (kvquant calibrates on them). The
model gets random weights (seeded), written as `$KVBITS_CACHE/models/smollm2` so that
`--model smollm2` finds it. Prints both texts, the CLI's timing lines and whether they agree."""
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM

src = Path(sys.argv[1])
cache = Path(os.environ.setdefault("KVBITS_CACHE", tempfile.mkdtemp()))
folder = cache / "models" / "smollm2"
folder.mkdir(parents=True, exist_ok=True)
for f in src.iterdir():
    shutil.copy(f, folder / f.name)
torch.manual_seed(0)
model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
sd = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
save_file(sd, str(folder / "model.safetensors"), metadata={"format": "pt"})
(folder / "kvbits-source.json").write_text(json.dumps({"format": 1, "gguf": "random weights",
                                                        "gguf_size": 0, "dtype": "float32"}))
texts = src.parent / "texts"  # calibration/evaluation texts (kvquant calibrates on the fly)
if texts.is_dir():
    shutil.copytree(texts, cache / "texts", dirs_exist_ok=True)
prompt = "The state of the union is strong. " * 40
outs = {}
for preset in ("kivi-2", "kvquant-3", "fp16"):
    for flag in ("--graphs", "--no-graphs"):
        cmd = [sys.executable, "-m", "kvbits.cli", "generate", "--model", "smollm2", "--preset",
               preset, "--prompt", prompt, "--max-new-tokens", "80", flag]
        r = subprocess.run(cmd, capture_output=True, text=True)
        outs[preset, flag] = r.stdout
        print(f"== {preset} {flag}: rc={r.returncode}\n{r.stdout[-300:]}\n{r.stderr[-1200:]}",
              flush=True)
    print(f"** {preset}: graphs and generate agree: "
          f"{outs[preset, '--graphs'] == outs[preset, '--no-graphs']}", flush=True)
