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

import org.apache.rocketmq.client.exception.MQClientException;
import org.apache.rocketmq.client.producer.SendResult;
import org.apache.rocketmq.client.producer.TransactionCheckListener;
import org.apache.rocketmq.client.producer.TransactionMQProducer;
import org.apache.rocketmq.common.message.Message;

/**
 * 发送事务消息例子
 */
public class TransactionProducer {
    public static void main(String[] args) throws MQClientException, InterruptedException {
        TransactionCheckListener transactionCheckListener = new TransactionCheckListenerImpl();
        TransactionMQProducer producer = new TransactionMQProducer("please_rename_unique_group_name");
        // 事务回查最小并发数
        producer.setCheckThreadPoolMinSize(2);
        // 事务回查最大并发数
        producer.setCheckThreadPoolMaxSize(2);
        // 队列数
        producer.setCheckRequestHoldMax(2000);
        producer.setTransactionCheckListener(transactionCheckListener);
        producer.setNamesrvAddr(System.getProperty("namesrv"));
        producer.start();

        String[] tags = new String[] { "TagA", "TagB", "TagC", "TagD", "TagE" };
        TransactionExecuterImpl tranExecuter = new TransactionExecuterImpl();
        for (int i = 0; i < 1; i++) {
            try {
                Message msg =
                    new Message("TopicTest", tags[i % tags.length], "KEY" + i,
                        ("Hello RocketMQ " + i).getBytes());
                SendResult sendResult = producer.sendMessageInTransaction(msg, tranExecuter, null);
                System.out.println(sendResult);
                Thread.sleep(10);
            }
            catch (MQClientException e) {
                e.printStackTrace();
            }
        }

        for (int i = 0; i < 100000; i++) {
            Thread.sleep(1000);
        }
        producer.shutdown();
    }
}
