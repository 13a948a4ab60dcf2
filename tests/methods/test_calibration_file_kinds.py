"""A calibration file of another kind given where one is read (a QA audit): each reader names
the file and what it expected instead of a bare decoding error or a layer count of 0."""

from __future__ import annotations

import json

import pytest
import torch

from kvbits.methods import fp8, hadamard


def test_hadamard_channels_from_a_binary_file_are_refused_by_name(tmp_path):
    """A safetensors file (fp8 scales, kvquant codebooks) read as Hadamard channels was a bare
    "'utf-8' codec can't decode byte ..." naming no file."""
    path = tmp_path / "scales.safetensors"
    fp8.save_fp8_scales(path, [(torch.ones(2), torch.ones(2))])
    with pytest.raises(ValueError, match=r"cannot read Hadamard channels from '.*scales"
                                         r"\.safetensors'"):
        hadamard.load_hadamard_channels(path)


def test_fp8_scales_from_a_file_of_other_tensors_are_refused_by_name(tmp_path):
    """A kvquant calibration (or any safetensors file without ``layer.{i}.k_scale``) read as fp8
    scales gave an empty list: "fp8 calibration has 0 layers, the model 2"."""
    from safetensors.torch import save_file

    path = tmp_path / "codebooks.safetensors"
    save_file({"layers.0.k_codebook": torch.zeros(2, 8)}, str(path),
              metadata={"format": "kvbits-kvquant-calibration-v1"})
    with pytest.raises(ValueError, match=r"codebooks\.safetensors' is not an fp8 scale file"):
        fp8.load_fp8_scales(path)
    ok = tmp_path / "ok.json"
    ok.write_text(json.dumps({"format": hadamard.FORMAT, "layers": [[[]]]}))
    assert hadamard.load_hadamard_channels(ok) == [[[]]]  # a JSON file still loads
