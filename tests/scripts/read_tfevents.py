"""Reads a folder of TensorBoard event files with TensorBoard's own reader and prints the
scalars as JSON: {tag: [[step, value], ...]}. Used by tests/tensorboard_test.cpp."""
import json
import sys

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

acc = EventAccumulator(sys.argv[1], size_guidance={"scalars": 0})
acc.Reload()
print(json.dumps({tag: [[e.step, e.value] for e in acc.Scalars(tag)]
                  for tag in acc.Tags()["scalars"]}))
