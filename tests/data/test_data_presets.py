import json
import time

import pandas as pd
import pytest
from hydra.utils import instantiate
from omegaconf import open_dict

from bnlit.data.pipeline import read_clean
from bnlit.data.shards import is_validation
from bnlit.errors import DataError
from helpers_data import document

PRESETS = {
    "bn_web": ["ai4bharat/sangraha", "HuggingFaceFW/fineweb-2", "wikimedia/wikipedia"],
    "bn_en_mix": ["ai4bharat/sangraha", "HuggingFaceFW/fineweb-2", "wikimedia/wikipedia", "HuggingFaceFW/fineweb-edu"],
}


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_presets_compose_with_hub_sources_and_char_weights(make_cfg, preset):
    cfg = make_cfg(f"data={preset}", "model=400m", tiny=False)
    sources = cfg.data.sources
    assert [s.hub_id for s in sources] == PRESETS[preset]
    for s in sources:
        assert s.language in ("bn", "en") and s.text_field == "text" and s.streaming and s.get("path") is None
        assert s.get("hub_config") or s.get("hub_data_dir")
    assert cfg.data.weight_unit == "chars" and cfg.data.clean.enabled
    assert cfg.data.seq_len == cfg.model.config.max_seq_len == 2048
    assert abs(sum(s.weight for s in sources) - 1.0) < 1e-9
    assert sum(s.weight for s in sources if s.language == "bn") == pytest.approx(1.0 if preset == "bn_web" else 0.8)


def test_offline_hub_source_fails_fast_with_the_dataset_id(make_cfg, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    cfg = make_cfg("data=bn_web")
    with open_dict(cfg):
        cfg.paths.cache_dir = str(tmp_path / "empty_cache")
        cfg.data.cache_dir = str(tmp_path / "empty_cache")
    dm = instantiate(cfg.data, _recursive_=False)
    start = time.monotonic()
    with pytest.raises(DataError, match=r"ai4bharat/sangraha \(verified/ben\).*hf download --repo-type dataset"):
        dm.prepare_data()
    assert time.monotonic() - start < 60


def write_fixture(path, texts):
    if path.suffix == ".parquet":
        pd.DataFrame({"text": texts, "id": range(len(texts))}).to_parquet(path)
    else:
        path.write_text("".join(json.dumps({"text": t, "title": "x"}, ensure_ascii=False) + "\n" for t in texts))


def test_mixture_preset_runs_on_local_fixtures_and_writes_the_data_report(make_cfg, tmp_path):
    cfg = make_cfg("data=bn_en_mix", "model.config.vocab_size=512", "data.seq_len=32")
    fixtures = {"sangraha_bn": ("parquet", "bn", 0), "fineweb2_bn": ("parquet", "bn", 1000),
                "wiki_bn": ("jsonl", "bn", 2000), "fineweb_edu_en": ("parquet", "en", 3000)}
    with open_dict(cfg):
        for s in cfg.data.sources:
            fmt, lang, seed = fixtures[s.name]
            texts = [document(seed + i, lang) for i in range(12)]
            if s.name == "fineweb2_bn":
                texts += [texts[0], "খুব ছোট।"]  # an exact duplicate and a too-short document
            path = tmp_path / f"{s.name}.{fmt}"
            write_fixture(path, texts)
            s.path, s.hub_id, s.streaming = str(path), None, False
            s.hub_config = s.hub_data_dir = None
            s.max_docs = None
    dm = instantiate(cfg.data, _recursive_=False)
    dm.prepare_data()
    dm.setup("fit")
    report = json.loads((tmp_path / "run" / "data_report.json").read_text())
    assert report["cleaned"] and report["validation_decontaminated"] is True
    fw = report["sources"]["fineweb2_bn"]
    assert fw["input"]["docs"] == 14 and fw["dropped"]["dedup"]["exact"] == 1
    assert fw["dropped"]["filters"]["docs"] == {"length": 1}
    assert fw["train"]["docs"] + fw["val"]["docs"] == 12
    bn = report["languages"]["bn"]
    assert bn["train"]["docs"] + bn["val"]["docs"] == 36 and bn["train"]["chars_per_token"] > 1
    assert set(report["decontam"]) <= {"val/bn", "val/en"}
    md = (tmp_path / "run" / "data_report.md").read_text()
    assert "fineweb2_bn | dedup | exact" in md and "length:min_chars" in md
    assert dm.mixture["unit"] == "chars"


def test_an_evaluation_file_is_checked_against_the_runs_training_text(make_cfg, tmp_path):
    from bnlit.data.report import check_against_training, validation_decontaminated

    cfg = make_cfg("data=files", "model.config.vocab_size=512", "data.seq_len=32")
    bn = [document(i) for i in range(30)]
    en = [document(i, "en") for i in range(30)]
    write_fixture(tmp_path / "bn.parquet", bn)
    write_fixture(tmp_path / "en.jsonl", en)
    bench = tmp_path / "bench.jsonl"  # a benchmark whose first item is copied into an English training document
    write_fixture(bench, [" ".join(en[3].split()[:30]), document(888, "en")])
    with open_dict(cfg):
        cfg.data.sources[0].path, cfg.data.sources[1].path = str(tmp_path / "bn.parquet"), str(tmp_path / "en.jsonl")
        cfg.data.sources[0].max_docs = cfg.data.sources[1].max_docs = None
        cfg.data.clean.decontam.eval_files = [{"path": str(bench), "name": "bench"}]
    dm = instantiate(cfg.data, _recursive_=False)
    dm.prepare_data()
    run = tmp_path / "run"
    report = json.loads((run / "data_report.json").read_text())
    assert not is_validation(en[3], cfg.data.val_fraction)  # the copy sits on the training side
    assert report["decontam"]["eval/bench"]["eval_docs_contaminated"] == 1
    assert report["sources"]["en"]["dropped"]["decontam"]["by_set"]["eval/bench"] == 1
    assert report["decontam"]["eval/bench"]["docs"] == 2
    assert validation_decontaminated(run) is True and validation_decontaminated(tmp_path) is None
    kept = set(read_clean(dm.clean_dir, dm.sources[0].name))
    train_doc = next(t for t in bn if t in kept and not is_validation(t, cfg.data.val_fraction))
    copied = " ".join(train_doc.split()[5:40])
    r = check_against_training([copied, document(777)], run)
    assert r["docs"] == 2 and r["eval_docs_contaminated"] == 1 and r["contamination_rate"] == 0.5
