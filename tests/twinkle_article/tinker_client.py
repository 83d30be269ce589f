# The article's Tinker Client program, as twinkle-kit 0.5.1's cookbook ships it
# (cookbook/client/tinker/self_host/self_cognition.py), with only the base model, the data path
# and the base URL changed: they come from the environment (TWINKLE_ARTICLE_*), so the test can
# point it at a tiny local model, a local copy of the dataset and a cluster on loopback. The
# model is a tiny text-only Qwen3.5, so its template is twinkle's `Template`: the article's
# `Qwen3_5Template` is the vision model's, whose processor needs torchvision (no CPU build of
# it is served here) and a vision model's rope index. Run by
# the twinkle-kit virtualenv's interpreter (`make install` builds .venv-sdk/twinkle-0.5.1); the
# last line it prints is a JSON summary for the test.
import json
import os
import numpy as np
from tqdm import tqdm
from tinker import types
from twinkle import init_tinker_client
from twinkle.data_format import Message, Trajectory
from twinkle.template import Template
from twinkle.dataloader import DataLoader
from twinkle.dataset import Dataset, DatasetMeta
from twinkle.preprocessor import SelfCognitionProcessor
from twinkle.server.common import input_feature_to_datum

# Initialize the Tinker client before importing ServiceClient
init_tinker_client()

from tinker import ServiceClient

# The base model to fine-tune / evaluate
base_model = os.environ['TWINKLE_ARTICLE_MODEL']
base_url = os.environ['TWINKLE_ARTICLE_BASE_URL']
api_key = os.environ['TWINKLE_ARTICLE_API_KEY']
dataset_path = os.environ['TWINKLE_ARTICLE_DATA']

summary = {'losses': [], 'metrics': [], 'saved': [], 'responses': []}


def train():
    # Step 1: Prepare the dataset

    # Load the self-cognition dataset (first 500 examples)
    dataset = Dataset(dataset_meta=DatasetMeta(dataset_path, data_slice=range(500)))

    # Apply the chat template matching the base model (max 256 tokens per sample)
    dataset.set_template('Template', model_id=base_model, max_length=256)

    # Replace placeholder names with custom model/author identity
    dataset.map(SelfCognitionProcessor('twinkle模型', 'twinkle团队'), load_from_cache_file=False)

    # Tokenize and encode the dataset into model-ready input features
    dataset.encode(batched=True, load_from_cache_file=False)

    # Wrap the dataset into a DataLoader that yields batches of size 8
    dataloader = DataLoader(dataset=dataset, batch_size=8)

    # Step 2: Initialize the training client

    service_client = ServiceClient(
        base_url=base_url,
        api_key=api_key
    )

    # Create a LoRA training client for the base model (rank=16 for the LoRA adapter)
    training_client = service_client.create_lora_training_client(base_model=base_model, rank=16)

    # Step 3: Run the training loop

    for epoch in range(3):
        print(f'Epoch {epoch}')
        for step, batch in tqdm(enumerate(dataloader)):
            # Convert each InputFeature into a Datum for the Tinker API
            input_datum = [input_feature_to_datum(input_feature) for input_feature in batch]

            # Send data to server: forward + backward pass (computes gradients)
            fwdbwd_future = training_client.forward_backward(input_datum, 'cross_entropy')

            # Optimizer step: update model weights with Adam
            optim_future = training_client.optim_step(types.AdamParams(learning_rate=1e-4))

            # Wait for both operations to complete
            fwdbwd_result = fwdbwd_future.result()
            optim_result = optim_future.result()

            # Compute weighted average log-loss per token for monitoring
            logprobs = np.concatenate([output['logprobs'].tolist() for output in fwdbwd_result.loss_fn_outputs])
            weights = np.concatenate([example.loss_fn_inputs['weights'].tolist() for example in input_datum])
            print(f'Loss per token: {-np.dot(logprobs, weights) / weights.sum():.4f}')
            print(f'Training Metrics: {optim_result}')
            summary['losses'].append(float(-np.dot(logprobs, weights) / weights.sum()))
            summary['metrics'].append(dict(optim_result.metrics or {}))

        # Save a checkpoint after each epoch
        save_future = training_client.save_state(f'twinkle-lora-{epoch}')
        save_result = save_future.result()
        print(f'Saved checkpoint to {save_result.path}')
        summary['saved'].append(save_result.path)


def eval():
    # Step 1: Load the trained LoRA checkpoint for inference

    # Path to a previously saved LoRA checkpoint (twinkle:// URI): the first epoch's, as
    # list_checkpoints' twinkle_path gives it
    weight_path = 'twinkle://' + summary['saved'][0].split('://', 1)[1]

    service_client = ServiceClient(base_url=base_url, api_key=api_key)
    sampling_client = service_client.create_sampling_client(model_path=weight_path, base_model=base_model)

    # Step 2: Prepare the chat prompt

    # Build a multi-turn conversation to test the model's self-cognition
    template = Template(model_id=base_model)

    trajectory = Trajectory(
        messages=[
            Message(role='system', content='You are a helpful assistant'),
            Message(role='user', content='你是谁？'),
        ]
    )

    input_feature = template.encode(trajectory, add_generation_prompt=True)

    input_ids = input_feature['input_ids'].tolist()

    # Step 3: Generate responses

    prompt = types.ModelInput.from_ints(input_ids)
    params = types.SamplingParams(
        max_tokens=50,  # Maximum tokens to generate
        temperature=0.2,  # Low temperature for more focused responses
    )

    # Sample 8 independent completions
    print('Sampling...')
    future = sampling_client.sample(prompt=prompt, sampling_params=params, num_samples=8)
    result = future.result()

    # Decode and print each response
    print('Responses:')
    for i, seq in enumerate(result.sequences):
        print(f'{i}: {repr(template.decode(seq.tokens))}')
        summary['responses'].append(list(seq.tokens))


if __name__ == '__main__':
    train()
    eval()
    print(json.dumps(summary))
