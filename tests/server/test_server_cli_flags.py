"""`brine serve`'s flags against `EngineConfig`: every field has its flag (or says what sets it instead), and a
flag whose `dest` is not the field it means fails loudly, at parser build or at config build, never silently."""

from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys

import pytest

from engine.config import EngineConfig
from server import cli, serve
from server.flags.engine_map import SET_OTHERWISE, UnknownEngineField, engine_flag


def _serve_parser() -> argparse.ArgumentParser:
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["serve"]


def test_every_engine_config_field_has_a_flag_or_a_reason() -> None:
    dests = {a.dest for a in _serve_parser()._actions}
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    assert fields - SET_OTHERWISE.keys() <= dests, "EngineConfig fields without a flag"
    assert set(SET_OTHERWISE) <= fields, "SET_OTHERWISE names a field EngineConfig does not have"
    assert not set(SET_OTHERWISE) & dests, "a field listed as set otherwise has a flag too"
    assert all(SET_OTHERWISE.values()), "each field set otherwise says by whom"


def test_a_mistyped_dest_fails_when_the_parser_is_built() -> None:
    parser = argparse.ArgumentParser()
    with pytest.raises(UnknownEngineField, match="'num_block' is not an EngineConfig field"):
        engine_flag(parser, "--num-kv-blocks", dest="num_block", type=int)
    with pytest.raises(UnknownEngineField, match="'max_num_seq' is not an EngineConfig field"):
        engine_flag(parser.add_argument_group("g"), "--max-num-seq", type=int)  # dest from the flag's name
    with pytest.raises(UnknownEngineField, match="'stat_loggers' is set otherwise"):
        engine_flag(parser, "--stat-loggers")
    engine_flag(
        argparse.ArgumentParser(), "--num-kv-blocks", dest="num_blocks"
    )  # the field's own name is fine


def test_a_mistyped_dest_fails_when_the_config_is_built() -> None:
    """A flag added with a plain add_argument and a misspelt dest: the field it meant has no flag, and the
    config refuses to build (the old copy skipped the field, so `--num-kv-blocks` silently did nothing)."""
    parsed = vars(cli.build_parser().parse_args(["serve", "--num-kv-blocks", "7"]))
    parsed["num_block"] = parsed.pop("num_blocks")
    with pytest.raises(UnknownEngineField, match="num_blocks"):
        serve.engine_config(argparse.Namespace(**parsed), [])


def test_a_field_without_a_flag_fails_when_the_config_is_built() -> None:
    parsed = vars(cli.build_parser().parse_args(["serve"]))
    del parsed["grammar_mask_budget_ms"]
    with pytest.raises(UnknownEngineField, match="grammar_mask_budget_ms"):
        serve.engine_config(argparse.Namespace(**parsed), [])


def test_every_engine_flag_reaches_its_field() -> None:
    """Each flag given moves its own field (`--num-kv-blocks` to num_blocks), and no other."""
    argv = ["serve", "/m", "--served-model-name=n", "--max-model-len=9", "--dtype=float32", "--device=cpu",
            "--threads=3", "--no-batch-invariant", "--quantization=none", "--enforce-eager",
            "--no-enable-prefix-caching", "--block-size=8", "--prefix-caching-hash-algo=xxhash",
            "--kv-cache-memory=1MiB", "--num-kv-blocks=5", "--kv-host-memory=2MiB", "--kv-disk-dir=/d",
            "--kv-disk-size=3MiB", "--max-retained-fraction=0.25", "--kv-disk-key-file=/k",
            "--kv-events-endpoint=tcp://127.0.0.1:5557", "--max-num-seqs=2", "--max-num-batched-tokens=32",
            '--speculative-config={"method": "ngram", "num_speculative_tokens": 2}', "--enable-lora",
            "--lora-modules", "a=/a", "--max-loras=2", "--max-lora-rank=4", "--grammar-compile-workers=1",
            "--grammar-compile-timeout=2.5", "--grammar-cache-memory=4MiB", "--grammar-mask-budget-ms=3.5"]  # fmt: skip
    config = serve.engine_config(cli.build_parser().parse_args(argv), [])
    default = EngineConfig()
    changed = {
        f.name
        for f in dataclasses.fields(EngineConfig)
        if getattr(config, f.name) != getattr(default, f.name)
    }
    by_flag = {o: a.dest for a in _serve_parser()._actions for o in a.option_strings}
    given = {"model"} | {by_flag[arg.split("=")[0]] for arg in argv if arg.startswith("--")}
    assert changed == given  # each flag given moved its own field, and no other
    assert (config.num_blocks, config.kv_disk_size, config.grammar_cache_memory) == (5, 3 * 2**20, 4 * 2**20)
    assert config.lora_modules == [("a", "/a")] and config.max_retained_fraction == 0.25


def test_parsing_flags_imports_no_torch() -> None:
    """`brine --help` stays instant: the flag groups and their engine map import no torch."""
    code = (
        "import sys\n"
        "from server import cli\n"
        "cli.build_parser().parse_args(['serve'])\n"
        "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)[:5]\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
