"""data.tokenizer: bytes, a tokenizer.json and a transformers directory; saving for transformers."""

import subprocess
import sys
from pathlib import Path

import pytest

from node.training.tokenizer import BYTE_EOS, load_tokenizer
from protocols.errors import ConfigError
from tests.unit.text_fixtures import EOS, sample_text, train_tokenizer

TEXTS = ["def f(x):\n    return x  # héllo wörld 😀\n", "  leading spaces\tand\ttabs\r\n", "", "\x00\x7f~ÿ"]


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory) -> Path:
    return train_tokenizer(tmp_path_factory.mktemp("bpe"), with_template=True)


def test_bpe_round_trips_and_skips_the_template(tokenizer_json: Path) -> None:
    tokenizer = load_tokenizer(str(tokenizer_json))
    assert tokenizer.vocab_size == 400 and tokenizer.eos_id == 0  # the trainer puts special tokens first
    encoded = tokenizer.encode_batch(TEXTS)
    assert [tokenizer.decode(ids) for ids in encoded] == TEXTS
    assert all(tokenizer.eos_id not in ids for ids in encoded)  # the EOS template is not applied
    assert len(encoded[0]) < len(TEXTS[0].encode())  # merges were learned and used
    assert len(tokenizer.sha256) == 32 and tokenizer.sha256 != load_tokenizer("bytes").sha256


def test_saved_tokenizer_loads_in_transformers_and_encodes_the_same(tokenizer_json: Path, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = load_tokenizer(str(tokenizer_json))
    saved = tokenizer.save(tmp_path / "out")
    assert sorted(p.name for p in saved) == ["special_tokens_map.json", "tokenizer.json", "tokenizer_config.json"]
    hf = AutoTokenizer.from_pretrained(tmp_path / "out")
    texts = [*TEXTS, sample_text(3000)]
    assert hf(texts)["input_ids"] == tokenizer.encode_batch(texts)
    assert hf.eos_token == EOS and hf.eos_token_id == tokenizer.eos_id
    assert hf.decode(tokenizer.encode_batch([TEXTS[0]])[0]) == TEXTS[0]
    # The saved directory is the same tokenizer to shoal, so a run can continue from it.
    reloaded = load_tokenizer(str(tmp_path / "out"))
    assert (reloaded.sha256, reloaded.eos_id) == (tokenizer.sha256, tokenizer.eos_id)


def test_bytes_tokenizer_ids_are_bytes_also_when_saved(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = load_tokenizer("bytes")
    assert (tokenizer.vocab_size, tokenizer.eos_id) == (256, BYTE_EOS)
    every_char = "".join(chr(c) for c in range(1, 600)) + "😀\r\n"
    texts = [*TEXTS, every_char]
    assert tokenizer.encode_batch(texts) == [list(t.encode()) for t in texts]
    tokenizer.save(tmp_path)
    hf = AutoTokenizer.from_pretrained(tmp_path)
    assert hf.vocab_size == 256
    assert hf(texts)["input_ids"] == [list(t.encode()) for t in texts]
    assert hf.decode(list(every_char.encode())) == every_char


def test_tokenizer_directory_is_read_through_transformers(tokenizer_json: Path) -> None:
    # A bare tokenizer.json directory: transformers loads it, and it is the same tokenizer.
    from_dir = load_tokenizer(str(tokenizer_json.parent))
    from_file = load_tokenizer(str(tokenizer_json))
    assert from_dir.encode_batch(TEXTS) == from_file.encode_batch(TEXTS)
    assert from_dir.sha256 == from_file.sha256


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda root: str(root / "missing" / "tokenizer.json"), r"data\.tokenizer: .*missing.* does not exist"),
        (lambda root: _write(root / "junk.json", "{not json"), r"is not a valid tokenizer\.json"),
        (lambda root: _write(root / "empty.json", '{"version": "1.0"}'), r"is not a valid tokenizer\.json"),
        (lambda root: str((root / "nothing").mkdir() or root / "nothing"), r"directory .*nothing has no tokenizer"),
    ],
)
def test_bad_tokenizer_specs_are_one_line_config_errors(tmp_path: Path, make, match: str) -> None:
    with pytest.raises(ConfigError, match=match) as error:
        load_tokenizer(make(tmp_path))
    assert "\n" not in str(error.value)


def test_hub_name_offline_says_how_to_fix_it(monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ConfigError, match=r"could not be fetched from the Hugging Face hub.*local tokenizer\.json"):
        load_tokenizer("someone/no-such-tokenizer")


def test_importing_the_data_modules_loads_neither_transformers_nor_datasets() -> None:
    code = ("import sys, node.training.tokenizer, node.training.documents, node.training.token_cache; "
            "print(sorted(m for m in ('transformers', 'datasets', 'tokenizers') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                            cwd=Path(__file__).resolve().parents[2])
    assert result.stdout.strip() == "[]"


def _write(path: Path, content: str) -> str:
    path.write_text(content)
    return str(path)
