"""Distillation: a student trained on a teacher's outputs (`lowbit distill`, docs/distill.md).

recover.py   --student QCKPT: a quantized checkpoint's scales, zero points, norms and biases
             trained block by block, then end to end on KL(teacher || student); same format out
trainable.py TrainableQuantLinear: fixed codes, trainable float parts with straight-through rounding
student.py   a quantized checkpoint as a trainable model, its identity check, and its writer
windows.py   training windows, held-out text, which windows a step sees
losses.py    normalized MSE and the KL divergence
layers.py    one decoder layer at a time, and the head alone
state.py     the resumable state in the work folder
"""
