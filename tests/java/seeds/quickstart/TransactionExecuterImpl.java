/*
 * The example program of a RocketMQ transaction-message article, as a user writes it (three files: this one,
 * TransactionCheckListenerImpl.java, TransactionExecuterImpl.java): the API before 4.3, a TransactionCheckListener and
 * a LocalTransactionExecuter; one message, its local transaction UNKNOW; the check-backs throw, answer UNKNOW three
 * times, then COMMIT. The article's code is kept as it is; changed are the imports (org.apache.rocketmq for the
 * com.alibaba.rocketmq of RocketMQ 3) and the name server address, taken from -Dnamesrv.
 *
 * Run against Apache RocketMQ 4.9.8 and against txmq by tests/test_rocketmq_article_examples.py.
 */
package com.zoo.quickstart.transaction;

import java.util.concurrent.atomic.AtomicInteger;

import org.apache.rocketmq.client.producer.LocalTransactionExecuter;
import org.apache.rocketmq.client.producer.LocalTransactionState;
import org.apache.rocketmq.common.message.Message;

/**
 * 执行本地事务
 */
public class TransactionExecuterImpl implements LocalTransactionExecuter {
    private AtomicInteger transactionIndex = new AtomicInteger(1);

    @Override
    public LocalTransactionState executeLocalTransactionBranch(final Message msg, final Object arg) {
        int value = transactionIndex.getAndIncrement();
        if (value == 0) {
            throw new RuntimeException("Could not find db");
        }
        else if ((value % 5) == 0) {
            return LocalTransactionState.ROLLBACK_MESSAGE;
        }
        else if ((value % 4) == 0) {
            return LocalTransactionState.COMMIT_MESSAGE;
        }
        return LocalTransactionState.UNKNOW;
    }
}
