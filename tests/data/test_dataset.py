"""PromptDataset: parquet/jsonl, keys, chat template, clear row errors, counted length filtering."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from transformers import PreTrainedTokenizerBase

from hybridrl.data.dataset import PromptDataset, PromptDatasetConfig
from hybridrl.data.rows import write_rows
from hybridrl.models.char_tokenizer import make_char_tokenizer


@pytest.fixture(scope="module")
def tok() -> PreTrainedTokenizerBase:
    return make_char_tokenizer(model_max_length=512)


@pytest.fixture(scope="module")
def plain_tok() -> PreTrainedTokenizerBase:
    t = make_char_tokenizer(model_max_length=512)
    t.chat_template = None
    return t


def decoded(ds: PromptDataset, i: int) -> str:
    return ds.tokenizer.decode(ds[i].prompt_ids)


def test_reads_a_list_of_parquet_and_jsonl_files(tmp_path: Path, tok: PreTrainedTokenizerBase) -> None:
    a = write_rows([{"prompt": "1+2=", "ground_truth": 3, "id": 7},
                    {"prompt": "4+4=", "ground_truth": 8, "id": 8}], tmp_path / "a.parquet")
    b = write_rows([{"prompt": "9+0=", "ground_truth": "9", "data_source": "hand"}], tmp_path / "b.jsonl")
    ds = PromptDataset([a, b], config=PromptDatasetConfig(apply_chat_template=False), tokenizer=tok)
    assert len(ds) == 3
    assert [decoded(ds, i) for i in range(3)] == ["1+2=", "4+4=", "9+0="]
    assert [ds[i].meta.ground_truth for i in range(3)] == ["3", "8", "9"]
    assert [ds[i].meta.data_source for i in range(3)] == ["a", "a", "hand"]
    assert ds[0].meta.extra == {"id": 7}


def test_chat_template_is_applied_when_configured_and_present(
    tmp_path: Path, tok: PreTrainedTokenizerBase, plain_tok: PreTrainedTokenizerBase
) -> None:
    f = write_rows([{"prompt": "1+2=", "ground_truth": "3"}], tmp_path / "t.jsonl")
    chat = PromptDataset([f], config=PromptDatasetConfig(max_prompt_length=100), tokenizer=tok)
    assert decoded(chat, 0) == "<|im_start|>user\n1+2=<|im_end|>\n<|im_start|>assistant\n"
    raw = PromptDataset([f], config=PromptDatasetConfig(apply_chat_template=False), tokenizer=tok)
    assert decoded(raw, 0) == "1+2="
    no_template = PromptDataset([f], config=PromptDatasetConfig(), tokenizer=plain_tok)
    assert decoded(no_template, 0) == "1+2="


def test_a_multi_turn_rollout_gets_the_prompt_s_messages_and_the_tools_in_its_render(tmp_path: Path) -> None:
    """``SampleMeta.messages``: what the prompt was rendered from (the rollout renders later turns after it);
    ``tools``: the schemas the template renders into the prompt, as Qwen's does."""
    t = make_char_tokenizer(model_max_length=512)
    t.chat_template = ("{%- if tools %}{{- 'tools: ' + tools | map(attribute='function.name') | join(',') + '\\n' }}"
                       "{%- endif %}" + t.chat_template)
    f = write_rows([{"prompt": "1+2=", "ground_truth": "3"},
                    {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2="}],
                     "ground_truth": "4"}], tmp_path / "t.jsonl")
    schema = {"type": "function", "function": {"name": "calculator", "description": "d", "parameters": {}}}
    ds = PromptDataset([f], config=PromptDatasetConfig(max_prompt_length=100, tools=[schema]), tokenizer=t)
    assert decoded(ds, 0) == "tools: calculator\n<|im_start|>user\n1+2=<|im_end|>\n<|im_start|>assistant\n"
    assert ds[0].meta.messages == [{"role": "user", "content": "1+2="}]
    assert ds[1].meta.messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2="}]
    g = write_rows([{"prompt": "1+2=", "ground_truth": "3"}], tmp_path / "plain.jsonl")
    raw = PromptDataset([g], config=PromptDatasetConfig(apply_chat_template=False, max_prompt_length=100),
                        tokenizer=t)
    assert raw[0].meta.messages is None  # a plain-text prompt: nothing for a multi-turn rollout to render after


def test_message_prompts_and_dotted_keys(tmp_path: Path, tok: PreTrainedTokenizerBase,
                                         plain_tok: PreTrainedTokenizerBase) -> None:
    messages = [{"role": "system", "content": "Add."}, {"role": "user", "content": "2+2="}]
    f = write_rows([{"question": messages, "reward_model": {"ground_truth": "4"}}], tmp_path / "m.parquet")
    cfg = PromptDatasetConfig(prompt_key="question", ground_truth_key="reward_model.ground_truth",
                              max_prompt_length=100)
    ds = PromptDataset([f], config=cfg, tokenizer=tok)
    assert decoded(ds, 0).startswith("<|im_start|>system\nAdd.<|im_end|>\n<|im_start|>user\n2+2=")
    assert ds[0].meta.ground_truth == "4"
    with pytest.raises(ValueError, match="list of chat messages, but the tokenizer has no chat template"):
        PromptDataset([f], config=cfg, tokenizer=plain_tok)


def test_bad_rows_name_file_row_and_key(tmp_path: Path, tok: PreTrainedTokenizerBase) -> None:
    f = write_rows([{"prompt": "1+1=", "ground_truth": "2"}, {"prompt": "2+2=", "ground_truth": "4"},
                    {"prompt": "3+3=", "answer": "6"}], tmp_path / "bad.jsonl")
    with pytest.raises(ValueError, match=r"bad\.jsonl row 2: missing key 'ground_truth' "
                                         r"\(data\.ground_truth_key\); the row has keys \['answer', 'prompt'\]"):
        PromptDataset([f], config=PromptDatasetConfig(), tokenizer=tok)
    g = write_rows([{"text": "1+1="}], tmp_path / "g.parquet")
    with pytest.raises(ValueError, match=r"g\.parquet row 0: missing key 'prompt' \(data\.prompt_key\)"):
        PromptDataset([g], config=PromptDatasetConfig(), tokenizer=tok)
    h = write_rows([{"prompt": 12, "ground_truth": "x"}], tmp_path / "h.jsonl")
    with pytest.raises(ValueError, match=r"h\.jsonl row 0: 'prompt' \(data\.prompt_key\) must be a string"):
        PromptDataset([h], config=PromptDatasetConfig(), tokenizer=tok)
    (tmp_path / "broken.jsonl").write_text('{"prompt": "1", "ground_truth": "1"}\n\n{oops\n')
    with pytest.raises(ValueError, match=r"broken\.jsonl line 3 \(row 1\): invalid JSON"):
        PromptDataset([tmp_path / "broken.jsonl"], config=PromptDatasetConfig(), tokenizer=tok)
    with pytest.raises(FileNotFoundError, match="nope.parquet"):
        PromptDataset([tmp_path / "nope.parquet"], config=PromptDatasetConfig(), tokenizer=tok)


def test_long_prompts_are_dropped_with_one_counted_warning(
    tmp_path: Path, tok: PreTrainedTokenizerBase, caplog: pytest.LogCaptureFixture
) -> None:
    rows = [{"prompt": "x" * n, "ground_truth": ""} for n in (3, 10, 4, 11, 12)]
    f = write_rows(rows, tmp_path / "len.parquet")
    cfg = PromptDatasetConfig(apply_chat_template=False, max_prompt_length=4, ground_truth_key=None)
    with caplog.at_level(logging.WARNING, logger="hybridrl.data.dataset"):
        ds = PromptDataset([f], config=cfg, tokenizer=tok)
    assert [len(ds[i].prompt_ids) for i in range(len(ds))] == [3, 4]
    assert ds[0].meta.ground_truth is None
    assert [r.getMessage() for r in caplog.records] == [
        "dropped 3 of 5 prompts longer than 4 tokens (data.max_prompt_length)"
    ]
    with pytest.raises(ValueError, match="no prompts left"):
        PromptDataset([f], config=PromptDatasetConfig(apply_chat_template=False, max_prompt_length=2,
                                                      ground_truth_key=None), tokenizer=tok)


def test_overlong_prompts_are_cut_as_data_truncation_says(tmp_path: Path, tok: PreTrainedTokenizerBase) -> None:
    """verl's data.filter_overlong_prompts=false + data.truncation: left keeps the last tokens, right the first,
    middle both ends (⌊max/2⌋ first, the rest last); error names the file and row. Short prompts are untouched."""
    f = write_rows([{"prompt": "abcdefghij", "ground_truth": "x"}, {"prompt": "ab", "ground_truth": "y"},
                    {"prompt": "0123456789", "ground_truth": "z"}], tmp_path / "long.jsonl")

    def cut(truncation: str) -> list[str]:
        cfg = PromptDatasetConfig(apply_chat_template=False, max_prompt_length=5, filter_overlong_prompts=False,
                                  truncation=truncation)
        ds = PromptDataset([f], config=cfg, tokenizer=tok)
        return [decoded(ds, i) for i in range(len(ds))]

    assert cut("left") == ["fghij", "ab", "56789"]
    assert cut("right") == ["abcde", "ab", "01234"]
    assert cut("middle") == ["abhij", "ab", "01789"]
    with pytest.raises(ValueError, match=r"long.jsonl row 0: the prompt has 10 tokens, over data.max_prompt_length=5 "
                                         r"\(2 such prompts in all\), and data.truncation=error"):
        cut("error")
    dropped = PromptDataset([f], config=PromptDatasetConfig(apply_chat_template=False, max_prompt_length=5),
                            tokenizer=tok)
    assert [decoded(dropped, i) for i in range(len(dropped))] == ["ab"]  # the default: dropped, counted
    with pytest.raises(ValueError, match="data.truncation='both'; valid: error, left, right, middle"):
        PromptDatasetConfig(truncation="both")
