"""Feature engineering for table data: Parquet rows -> joins -> feature stages -> tensors.

See :class:`TablePipeline` (outputs, shapes, dtypes), :class:`ColumnStage` (the contract of a
feature stage), :mod:`.ops` (the stages and their conventions), :mod:`.fit` (stored
statistics), :mod:`.dali` (the DALI engine) and ``pipelines/flights_features.yaml``.
"""
from .pipeline import TablePipeline
from .source import SchemaError, TableSource
from .stage import ColumnStage

__all__ = ["ColumnStage", "SchemaError", "TablePipeline", "TableSource"]
