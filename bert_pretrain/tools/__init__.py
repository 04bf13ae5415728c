"""What users run on a trained model or a finished run: export to Hugging Face format and back
(`bert-export`), loading any trained model (`model_loading`), `bert-predict`, `bert-attention`,
`bert-report` with its plotting, `bert-sweep-summary` and `bert-launch`."""
