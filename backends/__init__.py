"""
What an accelerator needs beyond plain torch, each in a room of its own: TorchTPU's calls (torchtpu.py, the
device type 'tpu') and Triton kernels for CUDA GPUs (kernels.py, train.py's key kernels). device.py is their door:
no other file of the kernel or the shell calls them.
"""
