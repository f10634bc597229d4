"""One request's facts and record: what the processor read and what each stage decided."""
