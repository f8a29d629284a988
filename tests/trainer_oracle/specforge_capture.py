"""SpecForge's offline training data from the installed package alone (SpecForge 0.2.0, SGLang 0.5.14),
on a CPU in one process: the hidden-state preparation its scripts/prepare_hidden_states.py performs,
composed here from the classes and functions SpecForge ships.

usage: specforge_capture.py --target DIR --draft-config JSON --data JSONL --chat-template NAME
       --templates JSON|- --output DIR --cache-dir DIR [--max-length N] [--batch-size N]
       [--mem-fraction-static F]

Why: that script is in neither SpecForge's wheel nor its PyPI sdist, so a run from package
registries alone (CI) cannot execute it. Every step that decides what is written is SpecForge's
(0.2.0; paths relative to its package):
* the capture plan: config/Config (an offline eagle3 run) resolved by
  application/composition.py resolve_offline_capture: the layers to capture (its default for the
  target when the draft config names none), the capture method, the OfflineCaptureLayout that
  names the persisted tensors, the loss-mask filter, the resolved draft config (draft_vocab_size);
* the target: offline_capture/sglang.py load_offline_capture (OfflineSGLangCapture over
  offline_capture/sglang_backend/capture.py OfflineSGLangCaptureBackend, SGLang's ModelRunner),
  set_capture_layers, capture; under distributed.py init_distributed / destroy_distributed;
* the data: utils.py safe_conversations_generator (read by datasets.Dataset.from_generator),
  utils.py load_tokenizer, data/preprocessing.py build_eagle3_dataset (chat template, loss mask,
  max_length, its default shuffle), data/utils.py prepare_dp_dataloaders (its collator pads);
* the vocabulary mapping: data/preprocessing.py generate_vocab_mapping_file, written as
  <output>/vocab_mapping/vocab_mapping.pt;
* each record: algorithms/common/providers.py OfflineCaptureLayout.materialize on one sample's
  input_ids, loss_mask, aux and last hidden states ([1, L, .]).
What this file does itself is the file I/O the script's own HiddenStatesGenerator does (it is part
of the script, not of the package): torch.save of each record, per-sample copies (a view would save
its whole batch's storage), to <output>/rows_<g>-<g+2000>/data_<i>.ckpt, the layout SpecForge's
offline reader reads (runtime/data_plane/offline_reader.py list_feature_files). Unlike the script,
a record with a NaN fails the run instead of being skipped with a warning, and the output is
written to <output>.partial and renamed when complete; an existing output is refused.
tests/test_specforge_writer_e2e.py checks these files tensor for tensor against the script's.
The CPU stand-ins are specforge_cpu.cpu_process's.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

from specforge_cpu import cpu_process, register_templates

GROUP = 2000  # files per rows_* folder: the script's --file-group-size default


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="specforge_capture.py")
    p.add_argument("--target", required=True)
    p.add_argument("--draft-config", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--chat-template", required=True)
    p.add_argument("--templates", default="-")
    p.add_argument("--output", required=True)
    p.add_argument("--cache-dir", required=True)
    p.add_argument("--max-length", type=int, default=2048)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--mem-fraction-static", type=float, default=0.4)
    return p.parse_args(argv)


def capture_plan(args: argparse.Namespace, target_config):
    """SpecForge's resolution of what an offline eagle3 run captures and persists."""
    from specforge.application import resolve_offline_capture
    from specforge.config import Config

    cfg = Config(
        model={
            "target_model_path": args.target,
            "draft_model_config": args.draft_config,
            "trust_remote_code": False,
            "cache_dir": args.cache_dir,
        },
        data={"hidden_states_path": args.output, "max_length": args.max_length},
        training={"strategy": "eagle3"},
    )
    return resolve_offline_capture(cfg, target_config=target_config)


def eagle3_dataset(args: argparse.Namespace, loss_mask_filter):
    from datasets import Dataset
    from specforge.data.preprocessing import build_eagle3_dataset
    from specforge.utils import load_tokenizer, safe_conversations_generator

    cache = Path(args.cache_dir)
    rows = Dataset.from_generator(
        generator=safe_conversations_generator,
        gen_kwargs={"file_path": args.data},
        cache_dir=str(cache / "hf_dataset"),
        num_proc=1,
    )
    tokenizer = load_tokenizer(args.target, trust_remote_code=False)
    return build_eagle3_dataset(
        dataset=rows,
        tokenizer=tokenizer,
        chat_template=args.chat_template,
        max_length=args.max_length,
        cache_dir=str(cache / "processed_dataset"),
        cache_key="difftest",
        is_preformatted=False,
        num_proc=1,
        loss_mask_filter=loss_mask_filter,
    )


def write(args: argparse.Namespace, out: Path) -> int:
    import torch
    from specforge.data.preprocessing import generate_vocab_mapping_file
    from specforge.data.utils import prepare_dp_dataloaders
    from specforge.distributed import get_dp_group, init_distributed
    from specforge.offline_capture import load_offline_capture
    from transformers import AutoConfig

    target_config = AutoConfig.from_pretrained(args.target, cache_dir=args.cache_dir)
    plan = capture_plan(args, target_config)
    draft_vocab = plan.draft_config.draft_vocab_size
    init_distributed(tp_size=1)
    print(
        f"SpecForge capture plan: {plan.capture_method} layers {list(plan.capture_layers)}, "
        f"records {list(plan.layout.output_names)}, draft vocab {draft_vocab}",
        flush=True,
    )
    dtype = getattr(target_config, "dtype", None) or target_config.torch_dtype
    target = load_offline_capture(
        args.target,
        torch_dtype=dtype,
        trust_remote_code=False,
        attention_backend="torch_native",
        mem_fraction_static=args.mem_fraction_static,
        max_running_requests=args.batch_size,
        max_total_tokens=args.batch_size * args.max_length,
    )
    target.set_capture_layers(list(plan.capture_layers), capture_method=plan.capture_method)
    data = eagle3_dataset(args, plan.loss_mask_filter)
    if not len(data):
        raise SystemExit(f"specforge_capture: no sample of {args.data} is left after SpecForge's preprocessing")
    text_config = getattr(target_config, "text_config", target_config)
    generate_vocab_mapping_file(
        dataset=data,
        target_vocab_size=int(text_config.vocab_size),
        draft_vocab_size=int(draft_vocab),
        cache_dir=str(out / "vocab_mapping"),
        cache_key="vocab_mapping",
    )
    loader = prepare_dp_dataloaders(
        dataset=data, batch_size=args.batch_size, num_workers=0, shuffle=False, process_group=get_dp_group()
    )
    index = 0
    with torch.no_grad():
        for batch in loader:
            got = target.capture(
                input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], loss_mask=batch["loss_mask"]
            )
            for i in range(batch["input_ids"].shape[0]):
                sources = {
                    "input_ids": batch["input_ids"][i],
                    "loss_mask": batch["loss_mask"][i],
                    "aux_hidden_states": got.hidden_states[i].unsqueeze(0),
                    "last_hidden_states": got.last_hidden_states[i].unsqueeze(0),
                }
                record = {k: v.detach().cpu().clone() for k, v in plan.layout.materialize(sources).items()}
                for name, t in record.items():
                    if t.is_floating_point() and bool(t.isnan().any()):
                        raise SystemExit(f"specforge_capture: sample {index}: NaN in the captured {name}")
                g = index // GROUP * GROUP
                path = out / f"rows_{g}-{g + GROUP}" / f"data_{index}.ckpt"
                path.parent.mkdir(parents=True, exist_ok=True)
                torch.save(record, path)
                index += 1
    return index


def main(argv: list[str]) -> int:
    args = parse(argv)
    out = Path(args.output)
    if out.exists():
        raise SystemExit(f"specforge_capture: --output {out} exists; give a new directory")
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    cpu_process()
    register_templates(args.templates)
    from specforge.distributed import destroy_distributed

    try:
        n = write(args, partial)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    finally:
        destroy_distributed()
    os.replace(partial, out)
    print(f"specforge_capture: {n} records and the vocabulary mapping in {out}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
