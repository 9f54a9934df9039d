"""The local tasks of ``bench.lm_eval_disagg``: a multiple-choice task (lm_eval's
``loglikelihood`` requests: one per choice) and a short-answer task (``generate_until``), each
a JSONL dataset and a task YAML written into a folder, so lm_eval needs no hub access.

The items are general-knowledge questions a 135M model gets partly right, so scores are not
all 0 or all 1 (a comparison of per-item results is then meaningful beyond "both failed").
"""

from __future__ import annotations

import json
from pathlib import Path

MC_TASK = "disagg_mc"
GEN_TASK = "disagg_gen"

# (question, choices, index of the right choice)
MC_ITEMS: tuple[tuple[str, tuple[str, ...], int], ...] = (
    ("What is the capital of France?", ("Paris", "Berlin", "Madrid", "Rome"), 0),
    ("What is the capital of Japan?", ("Beijing", "Seoul", "Tokyo", "Bangkok"), 2),
    ("What is the capital of Italy?", ("Milan", "Rome", "Naples", "Venice"), 1),
    ("What is the largest planet in the solar system?", ("Mars", "Earth", "Jupiter",
                                                         "Venus"), 2),
    ("Which planet is closest to the Sun?", ("Mercury", "Venus", "Earth", "Mars"), 0),
    ("What do bees make?", ("milk", "honey", "silk", "wool"), 1),
    ("How many legs does a spider have?", ("six", "eight", "ten", "four"), 1),
    ("How many days are in a week?", ("five", "six", "seven", "eight"), 2),
    ("What color is the sky on a clear day?", ("green", "red", "blue", "yellow"), 2),
    ("What is frozen water called?", ("steam", "ice", "sand", "glass"), 1),
    ("Which animal is known as the king of the jungle?", ("lion", "mouse", "cow", "duck"), 0),
    ("What gas do plants take in from the air?", ("oxygen", "helium", "carbon dioxide",
                                                  "neon"), 2),
    ("What is 2 plus 2?", ("three", "four", "five", "six"), 1),
    ("What is 10 minus 3?", ("seven", "six", "eight", "five"), 0),
    ("Which season comes after winter?", ("autumn", "summer", "spring", "fall"), 2),
    ("What is the opposite of hot?", ("warm", "cold", "big", "fast"), 1),
    ("Which organ pumps blood through the body?", ("lung", "liver", "heart", "brain"), 2),
    ("What do cows drink?", ("water", "oil", "gasoline", "ink"), 0),
    ("Which language is mainly spoken in Brazil?", ("Spanish", "Portuguese", "French",
                                                    "German"), 1),
    ("What is the boiling point of water at sea level in Celsius?", ("50", "100", "150",
                                                                      "200"), 1),
    ("Who wrote Romeo and Juliet?", ("Charles Dickens", "William Shakespeare", "Mark Twain",
                                     "Jane Austen"), 1),
    ("What is the chemical symbol for gold?", ("Ag", "Au", "Fe", "Pb"), 1),
    ("Which ocean is the largest?", ("Atlantic", "Indian", "Arctic", "Pacific"), 3),
    ("How many continents are there?", ("five", "six", "seven", "nine"), 2),
    ("What is the main language of the United States?", ("English", "Russian", "Chinese",
                                                          "Arabic"), 0),
    ("Which bird is a symbol of peace?", ("crow", "dove", "eagle", "owl"), 1),
    ("What do you use to write on a blackboard?", ("chalk", "soap", "butter", "glue"), 0),
    ("Which fruit is yellow and curved?", ("apple", "banana", "grape", "cherry"), 1),
    ("What is the tallest animal?", ("elephant", "giraffe", "horse", "camel"), 1),
    ("Where does the Sun rise?", ("north", "south", "east", "west"), 2),
    ("What is the capital of Germany?", ("Munich", "Hamburg", "Berlin", "Frankfurt"), 2),
    ("How many hours are in a day?", ("12", "24", "36", "48"), 1),
)

# (question, answer): answers of one word or number, compared case- and punctuation-blind
GEN_ITEMS: tuple[tuple[str, str], ...] = (
    ("What is the capital of France?", "Paris"),
    ("What is the capital of Spain?", "Madrid"),
    ("What is the capital of England?", "London"),
    ("What is the capital of Italy?", "Rome"),
    ("What is the capital of Japan?", "Tokyo"),
    ("What is the capital of Russia?", "Moscow"),
    ("What is the capital of Egypt?", "Cairo"),
    ("What is the capital of Canada?", "Ottawa"),
    ("What is 1 + 1?", "2"),
    ("What is 3 + 4?", "7"),
    ("What is 5 + 5?", "10"),
    ("What is 9 - 4?", "5"),
    ("What is 2 times 3?", "6"),
    ("What color is grass?", "green"),
    ("What color is snow?", "white"),
    ("What color is the sky?", "blue"),
    ("What color are bananas?", "yellow"),
    ("What animal says meow?", "cat"),
    ("What animal says woof?", "dog"),
    ("What animal says moo?", "cow"),
    ("What is the opposite of up?", "down"),
    ("What is the opposite of day?", "night"),
    ("What is the opposite of yes?", "no"),
    ("What is the opposite of black?", "white"),
    ("Which planet do we live on?", "Earth"),
    ("What star is at the center of our solar system?", "Sun"),
    ("What is the first month of the year?", "January"),
    ("What is the last month of the year?", "December"),
    ("What day comes after Monday?", "Tuesday"),
    ("How many legs does a dog have?", "4"),
    ("What do bees make?", "honey"),
    ("What is frozen water called?", "ice"),
)

GEN_DESCRIPTION = ("Answer each question with one word or number.\n\n"
                   "Question: What is the capital of Germany?\nAnswer: Berlin\n\n"
                   "Question: What is 2 + 2?\nAnswer: 4\n\n")

_MC_YAML = """task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: choices
doc_to_target: answer
num_fewshot: 0
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""

_GEN_YAML = """task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
description: {description}
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_target: answer
num_fewshot: 0
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 16
  do_sample: false
  temperature: 0
filter_list:
  - name: strip
    filter:
      - function: remove_whitespace
      - function: take_first
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
    ignore_case: true
    ignore_punctuation: true
metadata:
  version: 1.0
"""


def write_tasks(folder: Path) -> dict[str, int]:
    """Write both datasets and task YAMLs into ``folder`` (lm_eval's ``--include_path``);
    returns the number of items of each task."""
    folder.mkdir(parents=True, exist_ok=True)
    mc, gen = folder / f"{MC_TASK}.jsonl", folder / f"{GEN_TASK}.jsonl"
    mc.write_text("".join(json.dumps({"question": q, "choices": list(c), "answer": a}) + "\n"
                          for q, c, a in MC_ITEMS))
    gen.write_text("".join(json.dumps({"question": q, "answer": a}) + "\n"
                           for q, a in GEN_ITEMS))
    (folder / f"{MC_TASK}.yaml").write_text(_MC_YAML.format(task=MC_TASK, data=mc))
    (folder / f"{GEN_TASK}.yaml").write_text(_GEN_YAML.format(
        task=GEN_TASK, data=gen, description=json.dumps(GEN_DESCRIPTION)))
    return {MC_TASK: len(MC_ITEMS), GEN_TASK: len(GEN_ITEMS)}
