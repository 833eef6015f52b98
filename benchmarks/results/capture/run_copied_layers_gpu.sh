# One H200: the GPU tests of capture with copied layers (graphed decode over copied programs,
# the hybrids included), Zamba2-2.7B's time to start and batch-1 TPOT with copied layers, then
# (with mamba-ssm / causal-conv1d built from their sdists meanwhile) batch-1 TTFT at 4K of
# Mamba-2.8B and Mamba2-2.7B beside HF with the kernels.
#   bash benchmarks/results/capture/run_copied_layers_gpu.sh      # $OUT: logs/ and decode_*/
set -x
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader
mkdir -p $OUT/logs
( time bash benchmarks/build_peers.sh .sdist ) > $OUT/logs/build_peers.log 2>&1 &
timeout 240 python -m pytest tests/test_layer_repeat.py -k gpu -o addopts="" -q -p no:logging 2>&1 | tail -4 | tee $OUT/logs/gpu_tests_layer_repeat.log
timeout 200 python benchmarks/decode_gpu.py --out $OUT/decode_zamba2 --models zamba2-2.7b --variants ssmshard --batches 1 --repeats 3 --budget-s 190 2>&1 | grep -v Warning | grep '"tpot"\|"start"\|"ttft"\|environment' | cut -c1-600
wait
tail -3 $OUT/logs/build_peers.log
left=$((570 - SECONDS))
PYTHONPATH=/tmp/peers:$PWD timeout $left python benchmarks/decode_gpu.py --out $OUT/decode_ttft --models mamba2-2.7b mamba-2.8b --variants ssmshard hf --batches --budget-s $((left - 15)) 2>&1 | grep -v Warning | grep '"ttft"\|"hf_ttft"\|"start"\|environment\|skip' | cut -c1-600
