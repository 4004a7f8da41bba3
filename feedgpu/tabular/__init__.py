"""Feature engineering for table data: Parquet rows -> joins -> feature stages -> tensors.

See :class:`TablePipeline` (outputs, shapes, dtypes), :mod:`.ops` (the stages and their
conventions), :mod:`.fit` (stored statistics), :mod:`.dali` (the DALI engine) and
``pipelines/flights_features.yaml``.
"""
from .ops import Stage
from .pipeline import TablePipeline
from .source import SchemaError, TableSource

__all__ = ["SchemaError", "Stage", "TablePipeline", "TableSource"]
