"""A few seeds of each mode of the differential fuzzer (``fuzz_programs.py``): random valid
programs of cache operations through KVBitsCache against transformers' DynamicCache on tiny
random models. Lossless presets must give DynamicCache's logits at every forward; lossy ones
must only refuse with the documented errors, stay finite, report DynamicCache's lengths, and
give the same logits as a twin cache taken through save/load, deepcopy, row permutations and
draft verification. More seeds by hand: ``python tests/integrations/fuzz_programs.py --help``."""

import random

import pytest

import fuzz_programs as fz

SEEDS = range(8)


def _run(mode: str, seed: int):
    rng = random.Random(seed)
    arch = rng.choice(fz.ARCHS)
    if mode == "gen":
        return fz.run_gen(arch, rng.choice(fz.LOSSLESS), seed, rng)
    if mode == "rows":
        return fz.run_rows(arch, rng.choice(fz.LOSSY), seed, rng)
    preset = rng.choice(fz.LOSSLESS if mode == "lossless" else fz.LOSSY)
    prog = fz.gen_program(rng, mode == "lossy", mode == "twin")
    return fz.run_program(arch, preset, prog, seed, mode == "lossy", twin=mode == "twin")


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("mode", ["lossless", "lossy", "twin", "rows", "gen"])
def test_random_programs_agree_with_dynamic_cache(mode, seed):
    res = _run(mode, 1000 * seed + 62)
    assert res is None or res[0] == "refused", res
