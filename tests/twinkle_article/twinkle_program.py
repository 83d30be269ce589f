# The article's Twinkle Client program, as twinkle-kit 0.5.1's cookbook ships it
# (cookbook/client/twinkle/self_host/self_congnition.py), with the training steps the article
# spells out (clip_grad_norm, step, zero_grad, lr_step) and only the base model, the data path
# and the base URL changed: they come from the environment (TWINKLE_ARTICLE_*). Run by the
# twinkle-kit virtualenv's interpreter; the last line it prints is a JSON summary for the test.

# Step 1: Load environment variables from a .env file (e.g., API tokens)
import dotenv

dotenv.load_dotenv('.env')

import json
import os
from peft import LoraConfig

from twinkle import get_logger
from twinkle.dataset import DatasetMeta
from twinkle_client import init_twinkle_client
from twinkle_client.dataloader import DataLoader
from twinkle_client.dataset import Dataset
from twinkle_client.model import MultiLoraTransformersModel

logger = get_logger()

base_model = os.environ['TWINKLE_ARTICLE_MODEL']
base_url = os.environ['TWINKLE_ARTICLE_BASE_URL']
api_key = os.environ['TWINKLE_ARTICLE_API_KEY']
dataset_path = os.environ['TWINKLE_ARTICLE_DATA']
summary = {'models': [], 'runs': 0, 'steps': 0, 'metrics': [], 'saved': [], 'configs': None}


# Step 2: Initialize the Twinkle client to communicate with the remote server.
# - base_url: the address of the running Twinkle server
# - api_key: authentication token (loaded from environment variable)
client = init_twinkle_client(base_url=base_url, api_key=api_key)

# List available models of the server
print('Available models:')
for item in client.get_server_capabilities().supported_models:
    print('- ' + item.model_name)
    summary['models'].append(item.model_name)

# Step 3: Query the server for existing training runs and their checkpoints.
# This is useful for resuming a previous training session.
runs = client.list_training_runs()

resume_path = None
for run in runs:
    logger.info(run.model_dump_json(indent=2))
    summary['runs'] += 1
    # List all saved checkpoints for this training run
    checkpoints = client.list_checkpoints(run.training_run_id)

    for checkpoint in checkpoints:
        logger.info(checkpoint.model_dump_json(indent=2))
        # Uncomment the line below to resume from a specific checkpoint:
        # resume_path = checkpoint.twinkle_path


def train():
    # Step 4: Prepare the dataset

    # Load the self-cognition dataset
    dataset = Dataset(dataset_meta=DatasetMeta(dataset_path, data_slice=range(500)))

    # Apply a chat template so the data matches the model's expected input format
    dataset.set_template('Template', model_id=f'ms://{base_model}', max_length=512)

    # Replace placeholder names in the dataset with custom model/author names
    dataset.map('SelfCognitionProcessor', init_args={'model_name': 'twinkle模型', 'model_author': 'ModelScope社区'})

    # Tokenize and encode the dataset into model-ready input features
    dataset.encode(batched=True)

    # Wrap the dataset into a DataLoader that yields batches of size 4
    dataloader = DataLoader(dataset=dataset, batch_size=4)

    # Step 5: Configure the model

    # Create a multi-LoRA Transformers model pointing to the base model on ModelScope
    model = MultiLoraTransformersModel(model_id=f'ms://{base_model}')

    # Define LoRA configuration: apply low-rank adapters to all linear layers
    lora_config = LoraConfig(target_modules='all-linear')

    # Attach the LoRA adapter named 'default' to the model.
    # gradient_accumulation_steps=2 means gradients are accumulated over 2 micro-batches
    # before an optimizer step, effectively doubling the batch size.
    model.add_adapter_to_model('default', lora_config, gradient_accumulation_steps=2)

    # Set the same chat template used during data preprocessing
    model.set_template('Template')

    # Set the input processor (pads sequences on the right side)
    model.set_processor('InputProcessor', padding_side='right')

    # Use cross-entropy loss for language modeling
    model.set_loss('CrossEntropyLoss')

    # Use Adam optimizer with a learning rate of 1e-4 (Only support Adam optimizer if server use megatron)
    model.set_optimizer('Adam', lr=1e-4)

    # Use a linear learning rate scheduler (Do not support LR scheduler if server use megatron)
    model.set_lr_scheduler('LinearLR')

    # Step 6: Optionally resume from a previous checkpoint
    if resume_path:
        logger.info(f'Resuming model weights from {resume_path}')
        model.load(resume_path, load_optimizer=True)

    # Step 7: Run the training loop
    logger.info(model.get_train_configs().model_dump())
    summary['configs'] = model.get_train_configs().result

    for epoch in range(3):
        logger.info(f'Starting epoch {epoch}')
        for step, batch in enumerate(dataloader):
            # Forward pass + backward pass (computes gradients)
            model.forward_backward(inputs=batch)

            # Clip gradients to prevent exploding gradients (max norm = 1.0)
            model.clip_grad_norm(1.0)
            # Perform one optimizer step (update model weights)
            model.step()
            # Reset gradients to zero for the next iteration
            model.zero_grad()
            # Advance the learning rate scheduler by one step
            model.lr_step()
            summary['steps'] += 1

            # Log the loss every 2 steps (aligned with gradient accumulation)
            if step % 2 == 0:
                # Print metric
                metric = model.calculate_metric(is_training=True)
                logger.info(f'Current is step {step} of {len(dataloader)}, metric: {metric.result}')
                summary['metrics'].append(metric.result)

        # Step 8: Save the trained checkpoint
        twinkle_path = model.save(name=f'twinkle-epoch-{epoch}', save_optimizer=True)
        logger.info(f'Saved checkpoint: {twinkle_path}')
        summary['saved'].append(twinkle_path.twinkle_path)


if __name__ == '__main__':
    train()
    print(json.dumps(summary, ensure_ascii=False))
