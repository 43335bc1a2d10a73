rm -rf /tmp/site; mkdir -p /tmp/site && cp -rs $PWD/mtpchat /tmp/site/mtpchat && ln -s $PWD/engine /tmp/site/mtpchat/engine && ln -s $PWD/kernels /tmp/site/mtpchat/kernels && ln -s $PWD/assets /tmp/site/mtpchat/assets
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
timeout 100 python3 -P -m pytest -q tests/kernels/test_int4_gemm.py -k "requant" 2>&1 | tail -1
cd tests/bench
timeout 120 python3 probe_requantize.py 2>&1 | tail -5
for T in 2048 4096; do timeout 100 python3 bench_int4.py --prefill $T --prefill-only --json $OUT/prefill_$T.json 2>&1 | tail -6; done
