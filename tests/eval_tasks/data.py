"""The tiny tasks' documents, read from the jsonl file beside this module (a YAML's `data_files` would be read
relative to the working directory)."""
import json
from pathlib import Path

import datasets


def _split(name: str) -> datasets.DatasetDict:
    lines = (Path(__file__).parent / f"{name}.jsonl").read_text().splitlines()
    return datasets.DatasetDict({"test": datasets.Dataset.from_list([json.loads(line) for line in lines if line])})


def choice(**kwargs):
    return _split("tiny_choice")


def rolling(**kwargs):
    return _split("tiny_rolling")


def generate(**kwargs):
    return _split("tiny_generate")
