#!/bin/bash
# issue 30 section 2: the paper's pieces on SmolLM2-135M word problems (the settings of real_model/credit)
export PYTHONPATH=/work/wt/sm/src OMP_NUM_THREADS=1
M="uniform,value_head,vh_rw=value_head:form=reweight,continuation_likelihood,cl_sum=continuation_likelihood:continuation_likelihood.estimator=sum,cl_rw=continuation_likelihood:form=reweight,answer_likelihood"
nice -n 5 rredcot bench credit --checkpoint smollm2-135m-instruct --task word_problems \
  --methods "$M" --segmenters newline --prompts 8 --samples 6 --mc-k 8 --value-fit-batches 8 --value-fit-prompts 4 \
  --max-new-tokens 64 --temperature 0.6 --chunk-prompts 8 --out /work/logs/sm/out
