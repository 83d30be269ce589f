"""A Twinkle Client training loop on the model routes, run by the twinkle-kit virtualenv's
interpreter with the environment the article's programs take (TWINKLE_ARTICLE_*).
The batches come from twinkle's own Dataset/Template/DataLoader in this process; the model
calls are `twinkle_client`'s, unmodified: `MultiLoraTransformersModel` with gradient
accumulation, clipping, a scheduler, a save and a load. Prints one JSON line of what it saw.
Imports nothing of this repository (the twinkle-kit venv has none of it)."""

from __future__ import annotations

import json
import os

from peft import LoraConfig
from twinkle.dataloader import DataLoader
from twinkle.dataset import Dataset, DatasetMeta
from twinkle.preprocessor import SelfCognitionProcessor
from twinkle_client import init_twinkle_client
from twinkle_client.model import MultiLoraTransformersModel
from twinkle_client.sampler import vLLMSampler


def main() -> None:
    base_url, api_key = os.environ["TWINKLE_ARTICLE_BASE_URL"], os.environ["TWINKLE_ARTICLE_API_KEY"]
    base_model, data = os.environ["TWINKLE_ARTICLE_MODEL"], os.environ["TWINKLE_ARTICLE_DATA"]
    client = init_twinkle_client(base_url=base_url, api_key=api_key)
    models = [m.model_name for m in client.get_server_capabilities().supported_models]

    dataset = Dataset(dataset_meta=DatasetMeta(data, data_slice=range(16)))
    dataset.set_template("Template", model_id=base_model, max_length=128)
    dataset.map(SelfCognitionProcessor("twinkle模型", "ModelScope社区"))
    dataset.encode(batched=True)
    batches = [[dict(row) for row in batch] for batch in DataLoader(dataset=dataset, batch_size=4)]
    for batch in batches:
        for row in batch:
            for key, value in list(row.items()):
                if hasattr(value, "tolist"):
                    row[key] = value.tolist()

    model = MultiLoraTransformersModel(model_id=base_model)
    model.add_adapter_to_model("default", LoraConfig(r=4, target_modules="all-linear"),
                               gradient_accumulation_steps=2)
    model.set_template("Template")
    model.set_processor("InputProcessor", padding_side="right")
    model.set_loss("CrossEntropyLoss")
    model.set_optimizer("Adam", lr=1e-3)
    model.set_lr_scheduler("LinearLR", start_factor=1.0, end_factor=0.5, total_iters=4)
    configs = json.loads(model.get_train_configs().result)

    losses, norms = [], []
    for _ in range(3):
        for batch in batches:
            out = model.forward_backward(inputs=batch)
            losses.append(out.result["loss"])
            norms.append(model.clip_grad_norm(1.0).result)
            model.step()
            model.zero_grad()
            model.lr_step()
    metric = model.calculate_metric(is_training=True).result
    saved = model.save(name="twinkle-epoch-0", save_optimizer=True)
    run_id = saved.twinkle_path.removeprefix("twinkle://").split("/")[0]
    runs = client.list_training_runs(limit=1000)
    assert run_id in [run.training_run_id for run in runs]
    checkpoints = client.list_checkpoints(run_id)
    model.load(saved.twinkle_path, load_optimizer=True)
    after = model.forward_backward(inputs=batches[0]).result["loss"]

    sampler = vLLMSampler(model_id=base_model)
    sampler.set_template("Template", model_id=base_model, max_length=128)
    sampler.add_adapter_to_sampler("default", {"r": 4, "target_modules": "all-linear"})
    greedy = {"max_tokens": 6, "temperature": 0.0, "logprobs": 1}
    trajectory = {"messages": [{"role": "user", "content": "who are you?"}]}
    samples = {
        "trained": sampler.sample([trajectory], greedy, adapter_uri=saved.twinkle_path),
        "base": sampler.sample([trajectory], greedy, adapter_name="default"),
        "feature": sampler.sample([{"input_ids": batches[0][0]["input_ids"][:8]}],
                                  {"max_tokens": 4, "num_samples": 3, "seed": 7},
                                  adapter_uri=saved.twinkle_path),
    }
    print(json.dumps({
        "models": models,
        "batches": batches[:1],
        "configs": configs,
        "losses": losses,
        "norms": norms,
        "metric": metric,
        "saved": saved.twinkle_path,
        "checkpoints": [c.twinkle_path for c in checkpoints],
        "after_load": after,
        "samples": {name: [r.model_dump() for r in rs] for name, rs in samples.items()},
    }, ensure_ascii=False))


if __name__ == "__main__":
    main()
