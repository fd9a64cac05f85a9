#!/bin/bash
# issue 30 section 2: the paper's pieces on SmolLM2-135M word problems (the settings of
# results/real_model/credit; results/paper_method/credit_smollm2); runs this checkout's rredcot.
#   paper_method_credit_smollm2.sh OUT
here=$(cd "$(dirname "$0")" && pwd)
out=${1:?usage: paper_method_credit_smollm2.sh OUT}
export PYTHONPATH="$here/../../src${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=1
M="uniform,value_head,vh_rw=value_head:form=reweight,continuation_likelihood,cl_sum=continuation_likelihood:continuation_likelihood.estimator=sum,cl_rw=continuation_likelihood:form=reweight,answer_likelihood"
nice -n 5 python -m rredcot bench credit --checkpoint smollm2-135m-instruct --task word_problems \
  --methods "$M" --segmenters newline --prompts 8 --samples 6 --mc-k 8 --value-fit-batches 8 --value-fit-prompts 4 \
  --max-new-tokens 64 --temperature 0.6 --chunk-prompts 8 --out "$out"
