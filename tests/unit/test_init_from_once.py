"""`model.init_from` is resolved once per start (issue #50): a fine-tuning start reads the checkpoint's config.json
once, however many steps of the start (the config's validation, the layout checks, the tokenizer's vocabulary, the
weights' check against their headers, the model's build, the start-up line) need the model it defines.

Mutation: without the resolved model kept on the `[model]` section (ModelSection.build reading config.json at each
call, as before) this start reads it 5 times; without it handed to the weights' check (HFWeights reading it again),
twice (6 before issue #50). Reads are counted where files are opened (Path.read_bytes and read_text open through
Path.open).
"""

from __future__ import annotations

import builtins
import io
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from unittest import mock

import pytest

pytest.importorskip("transformers")

from test_init_from import fit_overrides, make_hf_model, save_checkpoint

from meshlm.config import load_config
from meshlm.train.trainer import fit


@pytest.mark.slow  # a one-step fine-tune from a fresh HF checkpoint (a tokenizer trained, the corpus cached): ~10 s
def test_a_fine_tuning_start_reads_config_json_once(tmp_path: Path) -> None:
    directory = save_checkpoint(make_hf_model(tie=False), tmp_path / "hf")
    config_json = (directory / "config.json").resolve()
    reads: Counter[str] = Counter()

    def counted(method: Callable) -> Callable:  # every way a file is opened (read_bytes/read_text use Path.open)
        def wrapper(target: object, *args: object, **kwargs: object) -> object:
            path = target if isinstance(target, Path) else Path(str(target)) if isinstance(target, str) else None
            if path is not None and path.name == "config.json" and path.resolve() == config_json:
                reads[method.__name__] += 1
            return method(target, *args, **kwargs)

        return wrapper

    overrides = fit_overrides(directory, tmp_path, tmp_path / "run", steps=1)
    with (
        mock.patch.object(Path, "open", counted(Path.open)),
        mock.patch.object(builtins, "open", counted(io.open)),
    ):
        fit(load_config(None, list(overrides.items())))
    assert sum(reads.values()) == 1, reads
