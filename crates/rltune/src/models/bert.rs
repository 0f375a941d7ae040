//! BERT encoders (`model_type = "bert"`) with a sequence-classification head. Placeholder.
