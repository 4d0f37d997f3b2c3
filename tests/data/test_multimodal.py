"""Prompts with images: the dots task's parquet reads back into ids, pixels and grids through the tiny Qwen2.5-VL's
processor; image tokens count in max_prompt_length; a wrong placeholder count or an unreadable image is an error
naming the file and row; ``hybridrl prepare multimodal`` embeds a jsonl's image files as verl does."""

from __future__ import annotations

import io
import json
from collections import deque
from pathlib import Path

import pytest
from PIL import Image
from transformers import AutoProcessor, ProcessorMixin

from hybridrl.cli import main as cli_main
from hybridrl.config.errors import DataError
from hybridrl.data.dots import DotsTaskConfig, dots_splits, draw_dots, write_dots_splits
from hybridrl.data.multimodal import MultimodalDatasetConfig, MultimodalPromptDataset
from hybridrl.data.rows import read_rows, write_rows
from hybridrl.models.tiny import TinyModelSpec
from hybridrl.models.tiny_vlm import IMAGE_PAD, make_tiny_vlm

SMALL_DOTS = DotsTaskConfig(num_train=24, num_test=8, seed=3)


@pytest.fixture(scope="module")
def processor(tmp_path_factory: pytest.TempPathFactory) -> ProcessorMixin:
    out = make_tiny_vlm(tmp_path_factory.mktemp("vlm") / "model", text=TinyModelSpec(layers=1))
    return AutoProcessor.from_pretrained(out)


def png(size: int = 56, dots: int = 1) -> bytes:
    buffer = io.BytesIO()
    draw_dots([(8 + 10 * i, 8) for i in range(dots)], size=size, radius=3).save(buffer, format="PNG")
    return buffer.getvalue()


def row(content: str, images: list, answer: str = "1") -> dict:
    return {"prompt": [{"role": "user", "content": content}], "images": images, "ground_truth": answer}


def dataset(path: Path, processor: ProcessorMixin, **config) -> MultimodalPromptDataset:
    return MultimodalPromptDataset([path], config=MultimodalDatasetConfig(**{"max_prompt_length": 128, **config}),
                                   processor=processor)


def blobs(image: Image.Image) -> int:
    """Connected dark regions (4-neighbour flood fill)."""
    width, height = image.size
    dark = {(x, y) for x in range(width) for y in range(height) if image.getpixel((x, y))[0] < 128}
    count = 0
    while dark:
        count += 1
        todo = deque([dark.pop()])
        while todo:
            x, y = todo.popleft()
            for near in ((x + 1, y), (x - 1, y), (x, y + 1), (x, y - 1)):
                if near in dark:
                    dark.remove(near)
                    todo.append(near)
    return count


def test_dots_are_deterministic_disjoint_and_counted_right() -> None:
    train, test = dots_splits(SMALL_DOTS)
    assert (train, test) == dots_splits(SMALL_DOTS) and dots_splits(DotsTaskConfig(num_train=24, num_test=8)) != \
        (train, test)
    assert len(train) == 24 and len(test) == 8
    images = [r["images"][0]["bytes"] for r in train + test]
    assert len(set(images)) == len(images)
    for r in train[:6]:
        image = Image.open(io.BytesIO(r["images"][0]["bytes"]))
        assert image.size == (56, 56) and blobs(image.convert("RGB")) == int(r["ground_truth"])
        assert r["prompt"] == [{"role": "user", "content": "<image>How many dots?"}] and r["data_source"] == "dots"
    assert {int(r["ground_truth"]) for r in train} <= set(range(1, 10))


def test_dots_parquet_reads_back_into_ids_pixels_and_grids(tmp_path: Path, processor: ProcessorMixin) -> None:
    paths = write_dots_splits(tmp_path, SMALL_DOTS)
    data = dataset(paths["train"], processor)
    assert len(data) == 24
    item = data[0]
    assert item.image_grid_thw.tolist() == [[1, 4, 4]] and item.pixel_values.shape == (16, 3 * 2 * 14 * 14)
    assert item.prompt_ids.count(processor.image_token_id) == 4
    assert processor.tokenizer.decode(item.prompt_ids) == (f"<|im_start|>user\n<|vision_start|>{IMAGE_PAD * 4}"
                                                           "<|vision_end|>How many dots?<|im_end|>\n"
                                                           "<|im_start|>assistant\n")
    assert item.meta.ground_truth == dots_splits(SMALL_DOTS)[0][0]["ground_truth"] and item.meta.data_source == "dots"
    assert "images" not in item.meta.extra and len(item.images) == 1 and item.images[0].size == (56, 56)
    assert item.meta.messages == [{"role": "user", "content": [{"type": "image"},
                                                               {"type": "text", "text": "How many dots?"}]}]


def test_image_paths_and_several_images_in_one_prompt(tmp_path: Path, processor: ProcessorMixin) -> None:
    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "a.png").write_bytes(png(56))
    (tmp_path / "b.png").write_bytes(png(28))
    rows = [row("<image>and<image>?", ["img/a.png", {"path": str(tmp_path / "b.png")}], "2"), row("no image", [])]
    data = dataset(write_rows(rows, tmp_path / "rows.jsonl"), processor)  # a relative path: from the file's folder
    assert data[0].image_grid_thw.tolist() == [[1, 4, 4], [1, 2, 2]]
    assert data[0].prompt_ids.count(processor.image_token_id) == 4 + 1 and data[0].pixel_values.shape[0] == 16 + 4
    assert data[1].image_grid_thw.shape == (0, 3) and processor.image_token_id not in data[1].prompt_ids


def test_image_tokens_count_in_max_prompt_length(tmp_path: Path, processor: ProcessorMixin) -> None:
    path = write_rows([row("<image>q", [{"bytes": png(56)}]), row("<image>q", [{"bytes": png(112)}])],
                      tmp_path / "rows.parquet")
    lengths = dataset(path, processor).tokens.lengths.tolist()
    assert lengths[1] - lengths[0] == 16 - 4
    kept = dataset(path, processor, max_prompt_length=lengths[0])
    assert len(kept) == 1 and kept.filter_metrics["data/prompts_dropped"] == 1.0
    with pytest.raises(DataError, match=rf"rows.parquet row 1: the prompt has {lengths[1]} tokens"):
        dataset(path, processor, max_prompt_length=lengths[0], filter_overlong_prompts=False)
    with pytest.raises(ValueError, match="would cut a prompt's image tokens"):
        dataset(path, processor, max_prompt_length=lengths[0], filter_overlong_prompts=False, truncation="left")


def test_placeholder_count_must_match_the_images(tmp_path: Path, processor: ProcessorMixin) -> None:
    path = write_rows([row("<image>q", [{"bytes": png()}]), row("<image><image>q", [{"bytes": png()}])],
                      tmp_path / "rows.parquet")
    with pytest.raises(DataError, match=r"rows.parquet row 1: the prompt has 2 <image> placeholders but 'images' "
                                        r"\(data.image_key\) holds 1 images"):
        dataset(path, processor)


@pytest.mark.parametrize(("entry", "what"), [({"bytes": b"not a png"}, r"9 bytes"),
                                             ({"path": "missing.png"}, r"file .*missing.png")])
def test_unreadable_image_names_file_row_and_image(tmp_path: Path, processor: ProcessorMixin, entry: object,
                                                  what: str) -> None:
    path = write_rows([row("<image>q", [{"bytes": png()}]), row("<image>q", [entry])], tmp_path / "rows.parquet")
    with pytest.raises(DataError, match=rf"rows.parquet row 1, image 0 of 'images': cannot read the image \({what}\)"):
        dataset(path, processor)


def test_prepare_multimodal_embeds_a_jsonls_images(tmp_path: Path, processor: ProcessorMixin,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "src"
    (src / "images").mkdir(parents=True)
    files = {}
    for i in range(3):
        files[i] = src / "images" / f"{i}.png"
        files[i].write_bytes(png(56, dots=i + 1))
    entries = ["images/0.png", {"path": "images/1.png"}, [str(files[2])]]  # relative, {"path"}, absolute
    with (src / "geo.jsonl").open("w") as f:
        for i, images in enumerate(entries):
            f.write(json.dumps({"problem": "<image>How many dots?", "answer": str(i + 1), "images": images,
                                "id": i}) + "\n")
    out = tmp_path / "out"
    assert cli_main(["prepare", "multimodal", str(out), "--from", str(src / "geo.jsonl"), "--test-size", "1",
                     "--seed", "0"]) == 0
    rows = [r for split in ("train", "test") for _, r in read_rows(out / f"{split}.parquet")]
    assert sorted(r["id"] for r in rows) == [0, 1, 2]
    for r in rows:
        assert r["images"][0]["bytes"] == files[r["id"]].read_bytes() and r["ground_truth"] == str(r["id"] + 1)
        assert r["prompt"] == [{"role": "user", "content": "<image>How many dots?"}] and r["data_source"] == "geo"
    assert len(dataset(out / "train.parquet", processor)) == 2

    (src / "bad.jsonl").write_text(json.dumps({"problem": "<image><image>?", "answer": "1", "images": ["images/0.png"]})
                                   + "\n" + json.dumps({"problem": "<image>?", "answer": "1", "images": ["nope.png"]}))
    capsys.readouterr()
    assert cli_main(["prepare", "multimodal", str(tmp_path / "bad"), "--from", str(src / "bad.jsonl"),
                     "--test-size", "1"]) == 2
    assert "bad.jsonl row 0: the question has 2 <image> placeholders but 'images' (--images-key) holds 1 images" \
        in capsys.readouterr().err
    (src / "bad.jsonl").write_text(json.dumps({"problem": "<image>?", "answer": "1", "images": ["nope.png"]}) + "\n")
    assert cli_main(["prepare", "multimodal", str(tmp_path / "bad"), "--from", str(src / "bad.jsonl"),
                     "--test-size", "1"]) == 2
    assert "bad.jsonl row 0, image 0 of 'images': cannot read the image (file " in capsys.readouterr().err
