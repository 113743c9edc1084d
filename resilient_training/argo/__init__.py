"""The resilient-training pipeline for Argo Workflows users without KFP (WorkflowTemplate, CronWorkflow, step entry)."""
