"""A user's own data: read rows from files, turn them into token documents, order them over epochs.

Three small modules, none of which imports the rest of meshrl (this package sits in the lowest
layer, beside envs/, so that both the SFT loop and the `dataset` environment use it):

- `sources`: rows from a JSONL file, a parquet file, or a folder written by datasets'
  ``save_to_disk``; each row remembers where it came from ("train.jsonl:17"), so a malformed
  row fails naming its file and line or is skipped and counted (``on_error``). pyarrow and
  datasets are imported only for the sources that need them (the `data` extra).
- `formats`: a row in one of three formats (``messages``, ``prompt`` + ``completion``, ``text``)
  -> a `Document`: token ids and, per token, whether the loss trains on it (assistant turns
  only by default), through the tokenizer's chat template or one given in the config.
- `order`: the seeded order of rows over epochs as a pure function of one integer cursor, so
  a checkpoint that stores the cursor resumes at exactly the next example.

docs/data.md is the user's guide.
"""

from .formats import COLUMNS, FORMATS, LOSS_ON, Document, Formatter, resolve_format
from .order import EpochOrder, split_validation
from .sources import Rows, columns_of, read_rows

__all__ = ["COLUMNS", "FORMATS", "LOSS_ON", "Document", "EpochOrder", "Formatter", "Rows", "columns_of",
           "read_rows", "resolve_format", "split_validation"]
