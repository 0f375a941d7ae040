//! DistilBERT encoders (`model_type = "distilbert"`) with a sequence-classification head. Placeholder.
